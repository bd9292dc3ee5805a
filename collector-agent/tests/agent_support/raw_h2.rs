//! Hand-made HTTP/2 bytes for the tests that play a misbehaving peer: a client that opens
//! `Watch` streams with a flow-control window of 0 (it never takes an event), garbage, an
//! oversized frame. HPACK is written as literal fields without indexing or Huffman coding
//! (RFC 7541 §6.2.2), which every decoder accepts.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const DATA: u8 = 0;
pub const HEADERS: u8 = 1;
pub const SETTINGS: u8 = 4;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;

/// One frame: 24-bit length, type, flags, stream id.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

pub fn settings(entries: &[(u16, u32)]) -> Vec<u8> {
    let mut p = Vec::new();
    for (id, v) in entries {
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&v.to_be_bytes());
    }
    frame(SETTINGS, 0, 0, &p)
}

fn literal(name: &str, value: &str) -> Vec<u8> {
    assert!(name.len() < 127 && value.len() < 127);
    let mut b = vec![0x00, name.len() as u8];
    b.extend_from_slice(name.as_bytes());
    b.push(value.len() as u8);
    b.extend_from_slice(value.as_bytes());
    b
}

/// The HEADERS frame of a gRPC call to `path` on stream `stream`.
pub fn grpc_headers(stream: u32, path: &str) -> Vec<u8> {
    let mut block = Vec::new();
    for (n, v) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "agent"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        block.extend(literal(n, v));
    }
    frame(HEADERS, END_HEADERS, stream, &block)
}

/// A DATA frame carrying one gRPC message (`msg`, uncompressed), ending the request.
pub fn grpc_message(stream: u32, msg: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8];
    p.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    p.extend_from_slice(msg);
    frame(DATA, END_STREAM, stream, &p)
}

/// `WatchRequest { min_interval_ms: 0, heartbeat_ms }` as protobuf.
pub fn watch_request(heartbeat_ms: u32) -> Vec<u8> {
    let mut b = vec![0x10];
    let mut v = heartbeat_ms;
    while v >= 0x80 {
        b.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
    b
}

/// A TCP connection to `to` from the loopback address `from` (127.0.0.x are all this host,
/// so one test can be several peers).
pub async fn connect_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(from, 0)).unwrap();
    s.connect(to).await.unwrap()
}

/// A connection from `from` that opens `streams` `Watch` streams (heartbeats every
/// `heartbeat_ms`) with a flow-control window of 0: it never takes an event.
pub async fn stalled_watches(
    from: IpAddr,
    to: SocketAddr,
    streams: u32,
    heartbeat_ms: u32,
) -> TcpStream {
    let mut c = connect_from(from, to).await;
    let mut out = PREFACE.to_vec();
    out.extend(settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 0)]));
    for i in 0..streams {
        let id = 1 + 2 * i;
        out.extend(grpc_headers(id, "/ai_lb.v1.MetricsService/Watch"));
        out.extend(grpc_message(id, &watch_request(heartbeat_ms)));
    }
    c.write_all(&out).await.unwrap();
    c
}

/// How a connection ended when read to the end.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The peer closed it (EOF or reset): `bytes` were read first.
    Closed { bytes: usize },
    /// Still open after `within`.
    Open,
}

/// Reads (and discards) what `c` receives until the peer closes it, for at most `within`.
/// Reading the socket does not open a stalled stream's window: only a WINDOW_UPDATE would.
pub async fn read_to_close(c: &mut TcpStream, within: Duration) -> Ended {
    let mut buf = vec![0u8; 16 * 1024];
    let mut bytes = 0;
    let read_all = async {
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => bytes += n,
            }
        }
    };
    match tokio::time::timeout(within, read_all).await {
        Ok(()) => Ended::Closed { bytes },
        Err(_) => Ended::Open,
    }
}

/// Whether the server answered a connection's opening (with its SETTINGS frame) rather than
/// closing it: sends the preface and an empty SETTINGS, then waits for the first bytes.
pub async fn handshake_answered(c: &mut TcpStream) -> bool {
    let mut out = PREFACE.to_vec();
    out.extend(settings(&[]));
    if c.write_all(&out).await.is_err() {
        return false;
    }
    let mut b = [0u8; 9];
    match tokio::time::timeout(Duration::from_secs(10), c.read(&mut b)).await {
        Ok(Ok(n)) => n > 0,
        Ok(Err(_)) => false,
        Err(_) => panic!("the server neither answered nor closed within 10 s"),
    }
}
