//! The example service, shared by `examples/grpc_echo.rs` and the tests:
//! its messages (prost), its generated client and server
//! (`verbio.echo.Echo.rs`, made by tonic-build's manual builder: see
//! `tests/generated_code.rs`), an implementation, and a client run that
//! checks every byte it gets back.
#![allow(dead_code)]

use std::pin::Pin;

use futures::Stream;
use tonic::{Request, Response, Status};

include!("verbio.echo.Echo.rs");

pub use echo_client::EchoClient;
pub use echo_server::{Echo, EchoServer};

/// A payload to echo.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    /// The bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub payload: Vec<u8>,
}

/// The payload, echoed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    /// The bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub payload: Vec<u8>,
}

/// Asks for `chunks` chunks of `chunk_len` bytes made from `seed`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamRequest {
    /// How many chunks.
    #[prost(uint32, tag = "1")]
    pub chunks: u32,
    /// Bytes per chunk.
    #[prost(uint32, tag = "2")]
    pub chunk_len: u32,
    /// What the bytes are made from.
    #[prost(uint64, tag = "3")]
    pub seed: u64,
}

/// One chunk of a stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Chunk {
    /// Its place in the stream, from 0.
    #[prost(uint32, tag = "1")]
    pub index: u32,
    /// Its bytes: [`chunk_bytes`] of the request's seed and this index.
    #[prost(bytes = "vec", tag = "2")]
    pub data: Vec<u8>,
}

/// Largest chunk the service makes (tonic's default message limit is
/// 4 MiB).
pub const MAX_CHUNK: u32 = 1 << 20;
/// Largest stream the service makes.
pub const MAX_STREAM: u64 = 1 << 30;

/// The bytes of chunk `index` of a stream made from `seed`
/// (a xorshift sequence, different for every chunk).
pub fn chunk_bytes(seed: u64, index: u32, len: usize) -> Vec<u8> {
    let mut x = seed ^ (u64::from(index) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The service: echoes, and streams chunks made on the fly (one at a time:
/// a stream holds one chunk's memory, whatever its length).
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoService;

type ChunkStream = Pin<Box<dyn Stream<Item = Result<Chunk, Status>> + Send>>;

#[tonic::async_trait]
impl Echo for EchoService {
    async fn unary_echo(
        &self,
        request: Request<EchoRequest>,
    ) -> Result<Response<EchoReply>, Status> {
        let payload = request.into_inner().payload;
        Ok(Response::new(EchoReply { payload }))
    }

    type StreamChunksStream = ChunkStream;

    async fn stream_chunks(
        &self,
        request: Request<StreamRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let StreamRequest {
            chunks,
            chunk_len,
            seed,
        } = request.into_inner();
        if chunk_len > MAX_CHUNK {
            return Err(Status::invalid_argument(format!(
                "chunk_len {chunk_len} is over {MAX_CHUNK} bytes"
            )));
        }
        if u64::from(chunks) * u64::from(chunk_len) > MAX_STREAM {
            return Err(Status::invalid_argument(format!(
                "{chunks} chunks of {chunk_len} bytes are over {MAX_STREAM} bytes"
            )));
        }
        let stream = futures::stream::iter((0..chunks).map(move |index| {
            Ok(Chunk {
                index,
                data: chunk_bytes(seed, index, chunk_len as usize),
            })
        }));
        Ok(Response::new(Box::pin(stream)))
    }
}

/// What went wrong in a client run.
pub type RunError = Box<dyn std::error::Error + Send + Sync>;

/// `calls` unary calls of `payload` bytes each, one after another, every
/// reply checked.
pub async fn unary_calls<T>(
    client: &mut EchoClient<T>,
    calls: usize,
    payload: usize,
    tag: u64,
) -> Result<(), RunError>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    for i in 0..calls {
        let sent = chunk_bytes(tag, i as u32, payload);
        let reply = client
            .unary_echo(EchoRequest {
                payload: sent.clone(),
            })
            .await?
            .into_inner();
        if reply.payload != sent {
            return Err(format!("call {i}: the reply differs from the request").into());
        }
    }
    Ok(())
}

/// A server stream of `chunks` chunks of `chunk_len` bytes, every byte
/// checked; the bytes received.
pub async fn stream_checked<T>(
    client: &mut EchoClient<T>,
    chunks: u32,
    chunk_len: u32,
    seed: u64,
) -> Result<u64, RunError>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let mut stream = client
        .stream_chunks(StreamRequest {
            chunks,
            chunk_len,
            seed,
        })
        .await?
        .into_inner();
    let mut next = 0u32;
    let mut bytes = 0u64;
    while let Some(chunk) = stream.message().await? {
        if chunk.index != next {
            return Err(format!("chunk {} came where {next} was due", chunk.index).into());
        }
        if chunk.data != chunk_bytes(seed, next, chunk_len as usize) {
            return Err(format!("chunk {next}: its bytes differ").into());
        }
        bytes += chunk.data.len() as u64;
        next += 1;
    }
    if next != chunks {
        return Err(format!("the stream ended after {next} of {chunks} chunks").into());
    }
    Ok(bytes)
}
