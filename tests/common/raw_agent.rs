//! A raw endpoint that plays an agent's part by hand, for tests of what a
//! broken or hostile `Rdma` peer can send.

use futures::{AsyncReadExt, AsyncWriteExt};
use verbio::ops::agent::wire::{Message, Settings};
use verbio::runtime::TcpStream;

/// Runs the agent's settings exchange by hand on `stream`, the side channel
/// of a raw connection: announces `recv_buf_count` receive buffers of
/// `recv_buf_size` bytes, a credit batch of 1 and `max_recv_wr`, then reads
/// the peer's settings (whatever they are).
pub async fn exchange_settings(
    stream: &mut TcpStream,
    recv_buf_size: usize,
    recv_buf_count: u32,
    max_recv_wr: u32,
) {
    let settings = Message::Settings(Settings {
        max_message_len: 1 << 20,
        recv_buf_size: recv_buf_size as u32,
        recv_buf_count,
        credit_batch: 1,
        max_recv_wr,
    });
    let mut frame = vec![0u8; settings.encoded_len()];
    settings.encode(&mut frame).unwrap();
    stream.write_all(&frame).await.unwrap();
    let mut theirs = [0u8; 512];
    let n = stream.read(&mut theirs).await.unwrap();
    assert!(n > 0, "the client's settings");
}
