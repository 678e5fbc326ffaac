//! Observability: every connection has a tracing span with the peer address
//! and both QP numbers (`conn_setup` while it is set up, `rdma` after), and
//! the agent task's events happen inside the `rdma` span.
//!
//! A minimal in-test subscriber records spans, their fields and the span
//! each event happens in (one test per binary: it is the global default).

mod common;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use verbio::runtime::sleep;
use verbio::RdmaBuilder;

#[derive(Debug, Clone, Default)]
struct SpanRec {
    name: &'static str,
    fields: HashMap<String, String>,
}

#[derive(Default)]
struct Log {
    spans: HashMap<u64, SpanRec>,
    /// (event message, name of the innermost span it happened in).
    events: Vec<(String, Option<&'static str>)>,
}

struct Recorder {
    next: AtomicU64,
    log: Arc<Mutex<Log>>,
}

thread_local! {
    static STACK: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut rec = SpanRec {
            name: span.metadata().name(),
            ..SpanRec::default()
        };
        span.record(&mut Fields(&mut rec.fields));
        self.log.lock().unwrap().spans.insert(id, rec);
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut log = self.log.lock().unwrap();
        if let Some(rec) = log.spans.get_mut(&span.into_u64()) {
            values.record(&mut Fields(&mut rec.fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let msg = fields.remove("message").unwrap_or_default();
        let top = STACK.with(|s| s.borrow().last().copied());
        let mut log = self.log.lock().unwrap();
        let name = top.and_then(|id| log.spans.get(&id)).map(|r| r.name);
        log.events.push((msg, name));
    }
    fn enter(&self, span: &Id) {
        STACK.with(|s| s.borrow_mut().push(span.into_u64()));
    }
    fn exit(&self, span: &Id) {
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            if let Some(i) = s.iter().rposition(|&x| x == span.into_u64()) {
                s.remove(i);
            }
        });
    }
}

#[test]
fn connections_and_agent_tasks_run_in_spans_naming_peer_and_qpns() {
    let log = Arc::new(Mutex::new(Log::default()));
    tracing::subscriber::set_global_default(Recorder {
        next: AtomicU64::new(0),
        log: log.clone(),
    })
    .expect("the only subscriber of this test binary");

    let (addr, server) = serve_rdma(RdmaBuilder::new, 1, |mut c| async move {
        let r = c.remove(0);
        let m = r.receive().await.expect("message");
        r.send(&m).await.expect("echo");
        assert_eq!(r.receive().await.expect("bye"), b"bye");
        let qpn = r.qp().qp_num();
        // Closing here marks the connection down (an event in its span).
        r.close().await.expect("close");
        sleep(Duration::from_millis(100)).await;
        qpn
    });
    let (rt, dev) = runtime_and_device();
    let client_qpn = block(&rt, async {
        let r = dial_rdma(RdmaBuilder::new(), &dev, addr).await;
        r.send(b"hi").await.unwrap();
        assert_eq!(r.receive().await.unwrap(), b"hi");
        assert_eq!(r.span().metadata().map(|m| m.name()), Some("rdma"));
        r.send(b"bye").await.unwrap();
        r.qp().qp_num()
    });
    let server_qpn = server.join().expect("server");

    let log = std::mem::take(&mut *log.lock().unwrap());
    let rdma: Vec<&SpanRec> = log.spans.values().filter(|s| s.name == "rdma").collect();
    assert_eq!(rdma.len(), 2, "one rdma span per side: {rdma:?}");
    let sides: Vec<(String, String)> = rdma
        .iter()
        .map(|s| {
            (
                s.fields["local_qpn"].clone(),
                s.fields["remote_qpn"].clone(),
            )
        })
        .collect();
    let want_client = (client_qpn.to_string(), server_qpn.to_string());
    let want_server = (server_qpn.to_string(), client_qpn.to_string());
    assert!(sides.contains(&want_client), "{sides:?}");
    assert!(sides.contains(&want_server), "{sides:?}");
    let client_span = rdma
        .iter()
        .find(|s| s.fields["local_qpn"] == client_qpn.to_string())
        .unwrap();
    assert_eq!(client_span.fields["peer"], addr.to_string());
    for s in &rdma {
        assert!(s.fields["peer"].starts_with("127.0.0.1:"), "{s:?}");
    }

    let setup: Vec<&SpanRec> = log
        .spans
        .values()
        .filter(|s| s.name == "conn_setup")
        .collect();
    assert_eq!(setup.len(), 2, "{setup:?}");
    for s in &setup {
        for f in ["role", "peer", "local_qpn", "remote_qpn"] {
            assert!(s.fields.contains_key(f), "{f} missing in {s:?}");
        }
    }
    let roles: Vec<&str> = setup.iter().map(|s| s.fields["role"].as_str()).collect();
    assert!(
        roles.contains(&"connect") && roles.contains(&"accept"),
        "{roles:?}"
    );

    // The agent task's own events are inside its connection's span.
    let settings: Vec<_> = log
        .events
        .iter()
        .filter(|(m, _)| m == "agent settings")
        .collect();
    assert_eq!(settings.len(), 2, "{:?}", log.events);
    assert!(settings.iter().all(|(_, span)| *span == Some("rdma")));
    let agent: Vec<_> = log
        .events
        .iter()
        .filter(|(m, _)| m == "agent started" || m == "agent connection down")
        .collect();
    assert_eq!(agent.len(), 3, "{:?}", log.events);
    assert!(
        agent.iter().all(|(_, span)| *span == Some("rdma")),
        "{agent:?}"
    );
    let connected: Vec<_> = log
        .events
        .iter()
        .filter(|(m, _)| m == "connected" || m == "accepted")
        .collect();
    assert_eq!(connected.len(), 2, "{:?}", log.events);
    assert!(connected
        .iter()
        .all(|(_, span)| *span == Some("conn_setup")));
}
