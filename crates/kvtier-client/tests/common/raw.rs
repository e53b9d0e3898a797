//! gRPC over raw HTTP/2: any bytes as a request body (framing included),
//! the status and the response messages back.

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use prost::Message;
use tonic::Code;
use tonic::codegen::{Service, http};
use tonic::transport::Channel;

pub struct Answer {
    pub code: Code,
    /// Percent-decoded, as the server wrote it.
    pub message: String,
    /// The response messages, unframed.
    pub messages: Vec<Bytes>,
}

/// One gRPC message: flag, length, bytes.
pub fn frame(flag: u8, len: u32, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u8(flag);
    out.put_u32(len);
    out.put_slice(payload);
    out.freeze()
}

/// `m`, encoded and framed.
pub fn message(m: &impl Message) -> Bytes {
    let bytes = m.encode_to_vec();
    frame(0, bytes.len() as u32, &bytes)
}

fn unframe(mut body: Bytes) -> Vec<Bytes> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        if body.len() < 5 + len {
            break;
        }
        out.push(body.slice(5..5 + len));
        body = body.slice(5 + len..);
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `body` to `path` (`/kvtier.v1.KvTier/GetSequence`).
pub async fn call(channel: &mut Channel, path: &str, body: Bytes) -> Answer {
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(http_body_util::Full::new(body)))
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx)).await.unwrap();
    let response = channel.call(request).await.expect("the server answers");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("a whole response body");
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .or_else(|| trailers.get(name))
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    let status = header("grpc-status").expect("a grpc-status");
    Answer {
        code: Code::from_i32(status.parse().unwrap()),
        message: percent_decode(&header("grpc-message").unwrap_or_default()),
        messages: unframe(collected.to_bytes()),
    }
}
