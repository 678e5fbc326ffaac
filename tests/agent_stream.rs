//! The adapters over an `Rdma` connection (soft device, two runtimes on two
//! threads): `RdmaStream` as a byte stream under a length-delimited codec,
//! its orderly end and back-pressure, and the `Sink` / `Stream` of messages.

mod common;

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use asynchronous_codec::{Bytes, Framed, LengthCodec};
use common::*;
use futures::future::{select, Either};
use futures::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use futures::{SinkExt, StreamExt};
use verbio::runtime::sleep;
use verbio::{MessageStream, RdmaBuilder, RdmaStream};

/// Frame sizes: empty, tiny, around the stream's chunk and the receive
/// buffers, and larger than a chunk.
const FRAMES: [usize; 9] = [0, 1, 7, 4095, 4096, 65_536, 65_537, 200_000, 3];

#[test]
fn a_length_delimited_codec_runs_over_the_stream() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let mut framed = Framed::new(RdmaStream::from(c.remove(0)), LengthCodec);
        let mut echoed = 0;
        while let Some(frame) = framed.next().await {
            let frame = frame.expect("frame");
            framed.send(frame).await.expect("echo");
            echoed += 1;
        }
        framed.close().await.expect("close");
        echoed
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut framed = Framed::new(RdmaStream::from(r), LengthCodec);
        for (i, &len) in FRAMES.iter().enumerate() {
            let frame = Bytes::from(pattern(len, i as u8));
            framed.send(frame.clone()).await.expect("send frame");
            let back = framed.next().await.expect("echo").expect("echo frame");
            assert_eq!(back, frame, "frame {i} of {len} bytes");
        }
        // Many small frames in one go.
        let small: Vec<Bytes> = (0..500u32)
            .map(|i| Bytes::from(i.to_le_bytes().to_vec()))
            .collect();
        let mut all = futures::stream::iter(small.clone().into_iter().map(Ok));
        framed.send_all(&mut all).await.expect("send_all");
        for want in &small {
            assert_eq!(&framed.next().await.unwrap().unwrap(), want);
        }
        framed.close().await.expect("close");
        assert!(framed.next().await.is_none(), "the echo side closed too");
    });
    assert_eq!(server.join().expect("server"), FRAMES.len() + 500);
}

#[test]
fn close_is_an_orderly_end_and_a_vanished_peer_is_a_reset() {
    let data = pattern(300_000, 5);
    let expect = data.clone();
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let mut s = RdmaStream::from(c.remove(0));
        // The first line through AsyncBufRead, the rest through AsyncRead.
        let mut got = Vec::new();
        let n = s.read_until(0x0a, &mut got).await.expect("read_until");
        assert_eq!(n, got.len());
        s.read_to_end(&mut got).await.expect("read to EOF");
        // EOF stays EOF.
        assert_eq!(s.read(&mut [0u8; 8]).await.unwrap(), 0);
        // The other direction is still open.
        s.write_all(b"thanks").await.unwrap();
        s.flush().await.unwrap();
        // Then this side goes away without closing its write half.
        drop(s);
        got
    });
    let (rt, dev) = runtime_and_device();
    block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut s = RdmaStream::with_chunk(Rc::new(r), 10_000);
        assert_eq!(s.chunk(), 10_000);
        for part in data.chunks(777) {
            s.write_all(part).await.unwrap();
        }
        s.close().await.unwrap();
        let e = s.write_all(b"late").await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
        let mut thanks = [0u8; 6];
        s.read_exact(&mut thanks).await.unwrap();
        assert_eq!(&thanks, b"thanks");
        let e = s.read(&mut [0u8; 8]).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    });
    assert!(server.join().expect("server") == expect);
}

#[test]
fn a_writer_waits_for_a_reader_that_does_not_read() {
    const LIMIT: u64 = 128 << 10;
    // More than the connection holds for a reader that does not read:
    // its 4 MiB staging ring (the stream's 64 KiB messages go staged, and
    // stay in the ring while the backlog is over the limit) and the
    // backlog. 4 MiB was that with a credit window of 64 (64 messages of
    // 64 KiB); with the window of 128 (`DEFAULT_RECV_BUF_COUNT`) all of
    // it fitted in the ring.
    const TOTAL: usize = 8 << 20;
    let looked = Arc::new(AtomicBool::new(false));
    let looked_srv = looked.clone();
    let (addr, server) = serve_rdma(
        || RdmaBuilder::new().max_unread_bytes(LIMIT),
        1,
        move |mut c| async move {
            let r = Rc::new(c.remove(0));
            // Reads nothing until the writer has looked (a fixed sleep
            // here raced the writer's start on a loaded host: the reader
            // began before the writer's 400 ms were up).
            let deadline = std::time::Instant::now() + WAIT;
            while !looked_srv.load(Ordering::Acquire) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the writer never looked"
                );
                sleep(Duration::from_millis(10)).await;
            }
            let unread = r.unread_bytes();
            let mut s = RdmaStream::new(r);
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.expect("read to EOF");
            (unread, got)
        },
    );
    let (rt, dev) = runtime_and_device();
    let done_early = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let mut s = RdmaStream::from(r);
        let data = pattern(TOTAL, 8);
        let mut write = Box::pin(async move {
            s.write_all(&data).await.unwrap();
            s.close().await.unwrap();
        });
        let early = match select(write.as_mut(), Box::pin(sleep(Duration::from_millis(400)))).await
        {
            Either::Left(_) => true,
            Either::Right(_) => false,
        };
        looked.store(true, Ordering::Release);
        if !early {
            write.await;
        }
        early
    });
    assert!(!done_early, "4 MiB went out to a reader that reads nothing");
    let (unread, got) = server.join().expect("server");
    // The backlog stops at the limit plus what was already in flight
    // (credits the peer held: 16 receive buffers of 4 KiB).
    assert!(unread <= LIMIT + (16 << 12), "unread backlog {unread}");
    assert_eq!(got, pattern(TOTAL, 8));
}

#[test]
fn messages_go_out_through_a_sink_and_come_in_through_a_stream() {
    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let stream = MessageStream::new(Rc::new(c.remove(0)));
        stream
            .map(|m| m.expect("message").into_vec())
            .collect::<Vec<_>>()
            .await
    });
    let (rt, dev) = runtime_and_device();
    let sent: Vec<Vec<u8>> = (0..100).map(|i| pattern(i * 97, i as u8)).collect();
    let to_send = sent.clone();
    block(&rt, async move {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        let (mut sink, mut incoming) = r.into_split();
        let mut items = futures::stream::iter(to_send.into_iter().map(Ok));
        sink.send_all(&mut items).await.expect("send_all");
        sink.close().await.expect("close");
        // Closed locally: this side's stream ends too.
        assert!(incoming.next().await.is_none());
    });
    assert_eq!(server.join().expect("server"), sent);
}
