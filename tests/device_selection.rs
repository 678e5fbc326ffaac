//! Requiring hardware: `RdmaBuilder::require_hardware` refuses the software
//! device with an error that says so, instead of falling back to `soft0`.

mod common;

use common::*;
use verbio::provider::{ProviderError, ProviderKind};
use verbio::{AgentError, RdmaBuilder};

#[test]
fn a_builder_that_requires_hardware_refuses_the_software_device() {
    let (rt, dev) = runtime_and_device();
    if dev.context().kind() != ProviderKind::Soft {
        println!("SKIPPED: the test device is hardware; this checks the soft refusal");
        return;
    }
    block(&rt, async {
        let any = "127.0.0.1:0".parse().unwrap();
        let e = RdmaBuilder::new()
            .require_hardware(true)
            .device(dev.clone())
            .listen(any)
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Config {
                    setting: "require_hardware",
                    ..
                }
            ),
            "{e}"
        );
        let e = RdmaBuilder::new()
            .require_hardware(true)
            .device_name("soft0")
            .listen(any)
            .unwrap_err();
        assert!(
            matches!(
                &e,
                AgentError::Device {
                    source: ProviderError::InvalidArgument { .. },
                    ..
                }
            ),
            "{e}"
        );
        // No name: this host's hardware if it has an active port, else a
        // clear refusal (never soft0).
        match RdmaBuilder::new().require_hardware(true).listen(any) {
            Ok(l) => println!("hardware present: listening on {:?}", l.local_addr()),
            Err(AgentError::Device { source, .. }) => {
                let text = source.to_string();
                assert!(
                    matches!(
                        source,
                        ProviderError::NoDevice { .. } | ProviderError::InvalidArgument { .. }
                    ),
                    "{text}"
                );
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
        // Without the requirement the same builder falls back and works.
        let l = RdmaBuilder::new().device_name("soft0").listen(any);
        assert!(l.is_ok(), "{:?}", l.err());
    });
}
