//! [`MessageStream`] and [`MessageSink`]: an [`Rdma`] connection's
//! received messages as a `futures::Stream`, and its outgoing ones as a
//! `futures::Sink`, on the public `receive_msg` / `send` path.

use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{ready, Context, Poll};

use futures::future::LocalBoxFuture;
use futures::{Future, Sink, Stream};

use super::error::{AgentError, CloseReason};
use super::msg::RecvMsg;
use super::rdma::Rdma;
use super::receive::Receive;

/// The messages the peer sends, in order, as a `Stream`. It ends (`None`)
/// when the connection closes in order (the peer closed or dropped its
/// side, or this side closed); any other failure is yielded once as an
/// error, then the stream ends.
pub struct MessageStream {
    rdma: Rc<Rdma>,
    receiving: Option<Receive>,
    done: bool,
}

impl std::fmt::Debug for MessageStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageStream")
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl MessageStream {
    /// The messages received on `rdma`.
    pub fn new(rdma: Rc<Rdma>) -> MessageStream {
        MessageStream {
            rdma,
            receiving: None,
            done: false,
        }
    }
}

impl Stream for MessageStream {
    type Item = Result<RecvMsg, AgentError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let rdma = &this.rdma;
        let f = this
            .receiving
            .get_or_insert_with(|| Receive::new(&rdma.shared));
        let res = ready!(Pin::new(f).poll(cx));
        this.receiving = None;
        match res {
            Ok(m) => Poll::Ready(Some(Ok(m))),
            Err(e) => {
                this.done = true;
                match e.close_reason() {
                    Some(CloseReason::Disconnected | CloseReason::Local) => Poll::Ready(None),
                    _ => Poll::Ready(Some(Err(e))),
                }
            }
        }
    }
}

/// Messages to send, as a `Sink<B>` of anything that is bytes (`Vec<u8>`,
/// `&'static [u8]`, `bytes::Bytes`, ...; the item type is inferred). One message is in flight at a
/// time: `poll_ready` waits for the previous one (and so for the peer's
/// credits). `poll_close` sends what is pending, then closes the
/// connection ([`Rdma::shutdown`]): the peer's [`MessageStream`] ends.
pub struct MessageSink<B = Vec<u8>> {
    rdma: Rc<Rdma>,
    sending: Option<LocalBoxFuture<'static, Result<(), AgentError>>>,
    closing: Option<LocalBoxFuture<'static, Result<(), AgentError>>>,
    item: PhantomData<fn(B)>,
}

impl<B> std::fmt::Debug for MessageSink<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageSink")
            .field("sending", &self.sending.is_some())
            .finish_non_exhaustive()
    }
}

impl<B> MessageSink<B> {
    /// Messages sent on `rdma`.
    pub fn new(rdma: Rc<Rdma>) -> MessageSink<B> {
        MessageSink {
            rdma,
            sending: None,
            closing: None,
            item: PhantomData,
        }
    }

    fn poll_sending(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), AgentError>> {
        if let Some(f) = self.sending.as_mut() {
            let r = ready!(f.as_mut().poll(cx));
            self.sending = None;
            r?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<B: AsRef<[u8]> + 'static> Sink<B> for MessageSink<B> {
    type Error = AgentError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), AgentError>> {
        self.get_mut().poll_sending(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: B) -> Result<(), AgentError> {
        let this = self.get_mut();
        let rdma = this.rdma.clone();
        // `poll_ready` made sure nothing is in flight.
        this.sending = Some(Box::pin(async move { rdma.send(item.as_ref()).await }));
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), AgentError>> {
        self.get_mut().poll_sending(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), AgentError>> {
        let this = self.get_mut();
        ready!(this.poll_sending(cx))?;
        let rdma = this.rdma.clone();
        let f = this
            .closing
            .get_or_insert_with(|| Box::pin(async move { rdma.shutdown().await }));
        f.as_mut().poll(cx)
    }
}

impl Rdma {
    /// The connection as a `Sink` of outgoing messages and a `Stream` of
    /// received ones (see [`MessageSink`], [`MessageStream`]).
    ///
    /// ```
    /// # mod verbio { pub use verbio_ops::*; pub mod ops { pub use verbio_ops::*; } pub mod runtime { pub use verbio_runtime::*; } pub use verbio_runtime::provider; }
    /// use futures::{SinkExt, StreamExt};
    /// use verbio::runtime::Runtime;
    /// use verbio::RdmaBuilder;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let rt = Runtime::new()?;
    /// rt.block_on(async {
    ///     let builder = RdmaBuilder::new().device_name("soft0");
    ///     let listener = builder.listen("127.0.0.1:0".parse()?)?;
    ///     let addr = listener.local_addr()?;
    ///     let (server, client) = futures::join!(listener.accept(), builder.connect(addr));
    ///     let (_, mut incoming) = server?.into_split::<Vec<u8>>();
    ///     let (mut outgoing, _) = client?.into_split();
    ///     outgoing.send(b"one".to_vec()).await?;
    ///     outgoing.send(b"two".to_vec()).await?;
    ///     outgoing.close().await?; // closes the connection: the stream ends
    ///     let got: Vec<Vec<u8>> = incoming.map(|m| m.unwrap().into_vec()).collect().await;
    ///     assert_eq!(got, [b"one".to_vec(), b"two".to_vec()]);
    ///     Ok(())
    /// })
    /// # }
    /// ```
    pub fn into_split<B>(self) -> (MessageSink<B>, MessageStream) {
        let rdma = Rc::new(self);
        (MessageSink::new(rdma.clone()), MessageStream::new(rdma))
    }
}
