//! Decides what a KV-event message from a model server says, or why it says nothing: vLLM's
//! ZeroMQ frames (topic, 8-byte big-endian sequence number, msgpack payload) and msgspec's
//! encoding of `KVEventBatch` (vllm-project/vllm `vllm/distributed/kv_events.py`; the fake
//! pod's `kv_events.rs` writes the same bytes).
//!
//! Both encodings vLLM has used are read: events as positional arrays with the tag first
//! (`array_like=True`, vLLM up to v0.23: `["BlockStored", block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id, medium, lora_name, ...]`) and as maps with the tag under
//! `"type"` (vLLM PR #42892); the batch as `[ts, events, data_parallel_rank?]` or as a map
//! with those keys. Trailing fields msgspec omits (`omit_defaults`) may be missing; fields
//! added after those we read are ignored. Block hashes are integers (vLLM's are unsigned
//! 64-bit, or signed from Python's `hash`; a negative one is taken as its two's-complement
//! bits) or bytes/strings (newer vLLM's `ExternalBlockHash` may be bytes), folded to 64 bits
//! with FNV-1a: the agent only needs them as identities.
//!
//! A malformed message is an error naming what was wrong; a malformed event inside a good
//! batch is an error for that event only. Nothing here panics.

use rmpv::Value;

/// One KV-cache change as the model server states it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Full blocks cached, in chain order; `token_ids` are theirs, concatenated.
    Stored {
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        /// vLLM's `medium` (`"GPU"`, `"CPU"`...), when stated.
        medium: Option<String>,
        /// Stated for a LoRA adapter's blocks (`lora_id` or `lora_name` not nil).
        lora: bool,
    },
    /// Cached blocks evicted.
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
    },
    /// Every cached block dropped (vLLM `reset_prefix_cache`).
    Cleared,
}

/// One decoded payload: its timestamp and each event, or why that event was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Result<Event, WireError>>,
    pub data_parallel_rank: Option<i64>,
}

/// One decoded message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: Batch,
}

/// What was wrong with a message or an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("expected 3 frames (topic, sequence, payload), got {0}")]
    Frames(usize),
    #[error("sequence frame has {0} bytes, expected 8")]
    Sequence(usize),
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    #[error("payload has {0} trailing bytes after the batch")]
    Trailing(usize),
    #[error("batch: {0}")]
    Batch(String),
    #[error("event {index}: {reason}")]
    Event { index: usize, reason: String },
}

/// Deepest nesting accepted in a payload (a batch is 4 levels deep).
const MAX_DEPTH: usize = 16;

/// Decodes one multipart message `[topic, seq, payload]`.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message, WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    let seq =
        <[u8; 8]>::try_from(seq.as_ref()).map_err(|_| WireError::Sequence(seq.as_ref().len()))?;
    Ok(Message {
        topic: topic.as_ref().to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| WireError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(WireError::Trailing(rd.len()));
    }
    let batch = Fields::of(&v, None)
        .ok_or_else(|| WireError::Batch(format!("expected an array or a map, got {}", kind(&v))))?;
    let ts = match batch.get(0, "ts") {
        Some(t) => t
            .as_f64()
            .or_else(|| t.as_i64().map(|i| i as f64))
            .ok_or_else(|| WireError::Batch(format!("ts is {}, not a number", kind(t))))?,
        None => return Err(WireError::Batch("no ts".into())),
    };
    let events = match batch.get(1, "events") {
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(WireError::Batch(format!(
                "events is {}, not an array",
                kind(other)
            )))
        }
        None => return Err(WireError::Batch("no events".into())),
    };
    let data_parallel_rank = batch.get(2, "data_parallel_rank").and_then(Value::as_i64);
    Ok(Batch {
        ts,
        events: events
            .iter()
            .enumerate()
            .map(|(index, e)| decode_event(e).map_err(|reason| WireError::Event { index, reason }))
            .collect(),
        data_parallel_rank,
    })
}

/// A struct's fields, positional or named. Positions count from the first field after the
/// tag (an array_like event's element 0 is its tag).
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// `skip` = how many leading array elements precede field 0 (the tag).
    fn of(v: &'a Value, skip: Option<usize>) -> Option<Fields<'a>> {
        match v {
            Value::Array(a) => Some(Fields::Array(a.get(skip.unwrap_or(0)..).unwrap_or(&[]))),
            Value::Map(m) => Some(Fields::Map(m)),
            _ => None,
        }
    }

    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(a) => a.get(pos),
            Fields::Map(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        }
    }

    fn len(&self) -> usize {
        match self {
            Fields::Array(a) => a.len(),
            Fields::Map(m) => m.len(),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension",
    }
}

/// FNV-1a 64 of `bytes`: a bytes/string block hash as a 64-bit identity.
fn fold(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn hash(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .ok_or_else(|| format!("{what} {i} is not a 64-bit integer")),
        Value::Binary(b) => Ok(fold(b)),
        Value::String(s) => Ok(fold(s.as_bytes())),
        other => Err(format!("{what} is {}, not an integer", kind(other))),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(a)) => a.iter().map(|h| hash(h, "block hash")).collect(),
        Some(other) => Err(format!("block_hashes is {}, not an array", kind(other))),
        None => Err("no block_hashes".into()),
    }
}

fn medium(v: Option<&Value>) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => Ok(s.as_str().map(str::to_string)),
        Some(other) => Err(format!("medium is {}, not a string", kind(other))),
    }
}

fn decode_event(v: &Value) -> Result<Event, String> {
    let tag = match v {
        Value::Array(a) => a.first().and_then(Value::as_str),
        Value::Map(m) => m
            .iter()
            .find(|(k, _)| k.as_str() == Some("type"))
            .and_then(|(_, t)| t.as_str()),
        other => return Err(format!("is {}, not an array or a map", kind(other))),
    }
    .ok_or("has no tag (array element 0 or \"type\")")?;
    let f = Fields::of(v, Some(1)).ok_or("has no fields")?;
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(f.get(0, "block_hashes"))?;
            let parent = match f.get(1, "parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(p) => Some(hash(p, "parent_block_hash")?),
            };
            let token_ids = match f.get(2, "token_ids") {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or_else(|| format!("token id {t} is not a 32-bit unsigned integer"))
                    })
                    .collect::<Result<Vec<u32>, String>>()?,
                Some(other) => return Err(format!("token_ids is {}, not an array", kind(other))),
                None => return Err("no token_ids".into()),
            };
            let block_size = match f.get(3, "block_size") {
                Some(b) => b
                    .as_u64()
                    .and_then(|b| u32::try_from(b).ok())
                    .filter(|b| *b > 0)
                    .ok_or_else(|| format!("block_size {b} is not a positive integer"))?,
                None => return Err("no block_size".into()),
            };
            let lora = [f.get(4, "lora_id"), f.get(6, "lora_name")]
                .iter()
                .any(|x| x.is_some_and(|v| !v.is_nil()));
            let medium = medium(f.get(5, "medium"))?;
            let expected = block_hashes.len() as u64 * u64::from(block_size);
            if token_ids.len() as u64 != expected {
                return Err(format!(
                    "BlockStored has {} token ids for {} blocks of {block_size}",
                    token_ids.len(),
                    block_hashes.len()
                ));
            }
            Ok(Event::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium,
                lora,
            })
        }
        "BlockRemoved" => Ok(Event::Removed {
            block_hashes: hashes(f.get(0, "block_hashes"))?,
            medium: medium(f.get(1, "medium"))?,
        }),
        "AllBlocksCleared" => Ok(Event::Cleared),
        other => Err(format!("unknown event type {other:?} ({} fields)", f.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ai_lb_fake_pod::kv_cache::KvEvent;
    use ai_lb_fake_pod::kv_events::{encode_batch, frames, WireFormat};

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![11, u64::MAX],
                parent_block_hash: Some(5),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![11],
            },
            KvEvent::AllBlocksCleared,
        ]
    }

    fn expected() -> Vec<Result<Event, WireError>> {
        vec![
            Ok(Event::Stored {
                block_hashes: vec![11, u64::MAX],
                parent: Some(5),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                medium: Some("GPU".into()),
                lora: false,
            }),
            Ok(Event::Removed {
                block_hashes: vec![11],
                medium: Some("GPU".into()),
            }),
            Ok(Event::Cleared),
        ]
    }

    /// The fake pod's encoder (byte-checked against msgspec's layout there) in both formats.
    #[test]
    fn reads_both_encodings_the_fake_pod_writes() {
        for format in [WireFormat::Array, WireFormat::Map] {
            let f = frames("t", 42, encode_batch(1.5, &sample(), 0, format));
            let m = decode_message(&f).unwrap();
            assert_eq!((m.topic.as_slice(), m.seq), (&b"t"[..], 42));
            assert_eq!(m.batch.ts, 1.5);
            assert_eq!(m.batch.data_parallel_rank, Some(0));
            assert_eq!(m.batch.events, expected(), "{format:?}");
        }
    }

    fn pack(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn older_and_newer_layouts_are_read() {
        // vLLM's first layout: no data_parallel_rank, BlockStored without medium, BlockRemoved
        // without medium; a newer one with extra trailing fields and a signed hash.
        let batch = Value::Array(vec![
            Value::from(2.0),
            Value::Array(vec![
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(-1i64)]),
                    Value::Nil,
                    Value::Array(vec![Value::from(7), Value::from(8)]),
                    Value::from(2),
                    Value::Nil,
                ]),
                Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(3)])]),
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::Binary(vec![1, 2])]),
                    Value::from(3),
                    Value::Array(vec![Value::from(9), Value::from(9)]),
                    Value::from(2),
                    Value::from(4),
                    s("GPU"),
                    Value::Nil,
                    Value::Array(vec![Value::Nil]),
                    Value::from(0),
                ]),
            ]),
        ]);
        let b = decode_batch(&pack(&batch)).unwrap();
        assert_eq!(b.data_parallel_rank, None);
        assert_eq!(
            b.events[0],
            Ok(Event::Stored {
                block_hashes: vec![u64::MAX],
                parent: None,
                token_ids: vec![7, 8],
                block_size: 2,
                medium: None,
                lora: false,
            })
        );
        assert_eq!(
            b.events[1],
            Ok(Event::Removed {
                block_hashes: vec![3],
                medium: None
            })
        );
        let Ok(Event::Stored {
            lora, block_hashes, ..
        }) = &b.events[2]
        else {
            panic!("{:?}", b.events[2]);
        };
        assert!(*lora, "lora_id 4 is an adapter's block");
        assert_eq!(block_hashes, &vec![fold(&[1, 2])]);
        // A batch that is a map, as an EventBatch without array_like encodes.
        let map = Value::Map(vec![
            (s("ts"), Value::from(1.0)),
            (
                s("events"),
                Value::Array(vec![Value::Map(vec![(s("type"), s("AllBlocksCleared"))])]),
            ),
        ]);
        assert_eq!(
            decode_batch(&pack(&map)).unwrap().events,
            vec![Ok(Event::Cleared)]
        );
    }

    #[test]
    fn garbage_is_an_error_naming_what_was_wrong() {
        let err = |frames: Vec<Vec<u8>>| decode_message(&frames).unwrap_err().to_string();
        assert_eq!(
            err(vec![vec![1]]),
            "expected 3 frames (topic, sequence, payload), got 1"
        );
        assert_eq!(
            err(vec![vec![], vec![0; 4], vec![0x90]]),
            "sequence frame has 4 bytes, expected 8"
        );
        let e = err(vec![vec![], vec![0; 8], vec![0x92, 0x01]]);
        assert!(e.starts_with("payload is not msgpack"), "{e}");
        assert_eq!(
            err(vec![vec![], vec![0; 8], vec![0x90, 0x90]]),
            "payload has 1 trailing bytes after the batch"
        );
        assert_eq!(
            err(vec![vec![], vec![0; 8], pack(&s("x"))]),
            "batch: expected an array or a map, got a string"
        );
        assert_eq!(
            err(vec![vec![], vec![0; 8], pack(&Value::Array(vec![s("x")]))]),
            "batch: ts is a string, not a number"
        );
        // A bad event spoils only itself.
        let batch = Value::Array(vec![
            Value::from(1.0),
            Value::Array(vec![
                Value::Array(vec![s("BlockMoved")]),
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(1)]),
                    Value::Nil,
                    Value::Array(vec![Value::from(1)]),
                    Value::from(2),
                ]),
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(1)]),
                    Value::Nil,
                    Value::Array(vec![Value::from(-1)]),
                    Value::from(1),
                ]),
                Value::from(3),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode_batch(&pack(&batch)).unwrap();
        let msgs: Vec<String> = b
            .events
            .iter()
            .map(|e| match e {
                Ok(_) => "ok".into(),
                Err(e) => e.to_string(),
            })
            .collect();
        assert_eq!(
            msgs,
            vec![
                "event 0: unknown event type \"BlockMoved\" (0 fields)".to_string(),
                "event 1: BlockStored has 1 token ids for 1 blocks of 2".into(),
                "event 2: token id -1 is not a 32-bit unsigned integer".into(),
                "event 3: is an integer, not an array or a map".into(),
                "ok".into(),
            ]
        );
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let mut bytes = vec![0x91; 10_000];
        bytes.push(0xc0);
        assert!(decode_batch(&bytes).is_err());
    }
}
