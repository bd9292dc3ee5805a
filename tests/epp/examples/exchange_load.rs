//! Drives a running `ai-lb-epp` the way Envoy does for streamed chat completions, to measure
//! the picker's cost per request and per echoed chunk (read its CPU time around a run):
//! `cargo run --release -p ai-lb-epp --example exchange_load -- GRPC_ADDR STREAMS CHUNKS
//! [CONCURRENCY [GAP_MS]]`, over one connection. Each stream sends request headers, a chat body, SSE response headers, CHUNKS
//! response chunks of ~100 bytes (the last ending the stream) GAP_MS apart (default 0: at once),
//! and reads every answer.

use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest,
};

fn headers(list: &[(&str, &str)], response: bool) -> ProcessingRequest {
    let h = HttpHeaders {
        headers: Some(HeaderMap {
            headers: list
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        ..HttpHeaders::default()
    };
    ProcessingRequest {
        request: Some(if response {
            processing_request::Request::ResponseHeaders(h)
        } else {
            processing_request::Request::RequestHeaders(h)
        }),
        ..ProcessingRequest::default()
    }
}

fn body(b: Vec<u8>, eos: bool, response: bool) -> ProcessingRequest {
    let b = HttpBody {
        body: b,
        end_of_stream: eos,
        ..HttpBody::default()
    };
    ProcessingRequest {
        request: Some(if response {
            processing_request::Request::ResponseBody(b)
        } else {
            processing_request::Request::RequestBody(b)
        }),
        ..ProcessingRequest::default()
    }
}

async fn one(
    mut client: ExternalProcessorClient<tonic::transport::Channel>,
    id: usize,
    chunks: usize,
    gap: std::time::Duration,
) -> anyhow::Result<usize> {
    let prompt = format!("request {id}: {}", "some words of a prompt ".repeat(40));
    let chat = format!(
        r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let mut msgs = vec![
        headers(
            &[(":path", "/v1/chat/completions"), (":method", "POST")],
            false,
        ),
        body(chat.into_bytes(), true, false),
        headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            true,
        ),
    ];
    for i in 0..chunks {
        let c = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\" tok{i}\"}}}}]}}\n\n");
        msgs.push(body(c.into_bytes(), i + 1 == chunks, true));
    }
    let paced = futures::StreamExt::then(tokio_stream::iter(msgs), move |m| async move {
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
        m
    });
    let mut answers = client.process(paced).await?.into_inner();
    let mut n = 0;
    while answers.message().await?.is_some() {
        n += 1;
    }
    Ok(n)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, streams, chunks, rest @ ..] = args.as_slice() else {
        anyhow::bail!("usage: exchange_load GRPC_ADDR STREAMS CHUNKS [CONCURRENCY [GAP_MS]]");
    };
    let addr = format!("http://{addr}");
    let streams: usize = streams.parse()?;
    let chunks: usize = chunks.parse()?;
    let conc: usize = rest.first().map_or(Ok(8), |c| c.parse())?;
    let gap = std::time::Duration::from_millis(rest.get(1).map_or(Ok(0), |g| g.parse())?);
    // One HTTP/2 connection, as Envoy keeps one per worker.
    let client = ExternalProcessorClient::connect(addr).await?;
    let start = Instant::now();
    let mut answered = 0;
    for batch in (0..streams).collect::<Vec<_>>().chunks(conc.max(1)) {
        let tasks: Vec<_> = batch
            .iter()
            .map(|&i| tokio::spawn(one(client.clone(), i, chunks, gap)))
            .collect();
        for t in tasks {
            answered += t.await??;
        }
    }
    println!(
        "{streams} streams x {chunks} chunks: {answered} answers in {:.2}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
