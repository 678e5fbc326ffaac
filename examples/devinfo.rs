//! `devinfo`: prints what `ibv_devinfo -v` prints (the useful part) for every
//! device of both providers: the software device and, with the `ibverbs`
//! feature, the RDMA devices libibverbs lists.
//!
//! Run:
//!
//! ```text
//! cargo run --example devinfo                       # soft0 only
//! cargo run --example devinfo --features ibverbs    # soft0 + hardware
//! cargo run --example devinfo --features ibverbs -- -d rxe0   # one device
//! ```
//!
//! On a machine without RDMA, see `scripts/rxe-test.sh` (it runs this example
//! inside the rxe VM).

mod cli;

use std::process::ExitCode;

use verbio::provider::{self, Context, DeviceInfo, LinkLayer, Mtu, PortState, ProviderKind};

fn guid_str(g: u64) -> String {
    let b = g.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

fn state_str(s: PortState) -> &'static str {
    match s {
        PortState::Nop => "PORT_NOP (0)",
        PortState::Down => "PORT_DOWN (1)",
        PortState::Init => "PORT_INIT (2)",
        PortState::Armed => "PORT_ARMED (3)",
        PortState::Active => "PORT_ACTIVE (4)",
        PortState::ActiveDefer => "PORT_ACTIVE_DEFER (5)",
    }
}

fn mtu_str(m: Mtu) -> String {
    format!("{} ({})", m.bytes(), m as u8)
}

fn link_str(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::InfiniBand => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
        LinkLayer::Unspecified => "Unspecified",
    }
}

fn transport(ctx: &Context) -> &'static str {
    #[cfg(feature = "ibverbs")]
    if let Some(ib) = ctx.as_ibverbs() {
        return ib.transport();
    }
    let _ = ctx;
    "verbio software device (TCP)"
}

/// GID table rows: (index, gid, type).
fn gids(ctx: &Context, port: u8, len: u32) -> Vec<(u32, String, String)> {
    #[cfg(feature = "ibverbs")]
    if let Some(ib) = ctx.as_ibverbs() {
        return match ib.gid_table(port) {
            Ok(t) => t
                .iter()
                .map(|e| (e.index, e.gid.to_string(), e.gid_type.to_string()))
                .collect(),
            Err(e) => vec![(0, format!("<error: {e}>"), String::new())],
        };
    }
    (0..len)
        .filter_map(|i| ctx.query_gid(port, i).ok().map(|g| (i, g)))
        .filter(|(_, g)| !g.is_zero())
        .map(|(i, g)| (i, g.to_string(), "soft".to_string()))
        .collect()
}

fn print_device(info: &DeviceInfo) -> Result<(), provider::ProviderError> {
    let ctx = Context::open(info)?;
    let dev = ctx.query_device()?;
    println!("hca_id:\t{}", ctx.name());
    println!("\tprovider:\t\t\t{}", ctx.kind());
    println!("\ttransport:\t\t\t{}", transport(&ctx));
    println!("\tfw_ver:\t\t\t\t{}", dev.fw_ver);
    println!("\tnode_guid:\t\t\t{}", guid_str(dev.node_guid));
    println!("\tvendor_id:\t\t\t{:#x}", dev.vendor_id);
    println!("\tvendor_part_id:\t\t\t{}", dev.vendor_part_id);
    println!("\thw_ver:\t\t\t\t{:#x}", dev.hw_ver);
    println!("\tphys_port_cnt:\t\t\t{}", dev.phys_port_cnt);
    println!(
        "\tmax_qp: {}  max_qp_wr: {}  max_sge: {}  max_cqe: {}  max_mr_size: {:#x}",
        dev.max_qp, dev.max_qp_wr, dev.max_sge, dev.max_cqe, dev.max_mr_size
    );
    for port in 1..=dev.phys_port_cnt {
        let p = ctx.query_port(port)?;
        println!("\t\tport:\t{port}");
        println!("\t\t\tstate:\t\t\t{}", state_str(p.state));
        println!("\t\t\tmax_mtu:\t\t{}", mtu_str(p.max_mtu));
        println!("\t\t\tactive_mtu:\t\t{}", mtu_str(p.active_mtu));
        println!("\t\t\tport_lid:\t\t{}", p.lid);
        println!("\t\t\tlink_layer:\t\t{}", link_str(p.link_layer));
        for (i, gid, ty) in gids(&ctx, port, p.gid_tbl_len) {
            println!("\t\t\tGID[{i:>3}]:\t\t{gid}, {ty}");
        }
        match ctx.default_gid_index(port) {
            Ok(i) => println!("\t\t\tdefault GID index:\t{i}"),
            Err(e) => println!("\t\t\tdefault GID index:\t<{e}>"),
        }
    }
    println!();
    Ok(())
}

/// Lists the RDMA devices and their ports, as `ibv_devinfo -v`.
#[derive(clap::Parser)]
struct Args {
    /// Show only this device.
    #[arg(short, long)]
    device: Option<String>,
}

fn main() -> ExitCode {
    let only = <Args as clap::Parser>::parse().device;
    cli::init_tracing();
    let mut list = match provider::devices() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("devinfo: listing devices: {}", cli::chain(&e));
            return ExitCode::FAILURE;
        }
    };
    if let Some(name) = &only {
        let here: Vec<String> = list.iter().map(|d| d.name.clone()).collect();
        list.retain(|d| &d.name == name);
        if list.is_empty() {
            eprintln!(
                "devinfo: no device named {name:?}; the devices here: {}",
                here.join(", ")
            );
            return ExitCode::FAILURE;
        }
    }
    let mut failed = false;
    for info in &list {
        if let Err(e) = print_device(info) {
            let kind = match info.kind {
                ProviderKind::Soft => "soft",
                _ => "ibverbs",
            };
            eprintln!("devinfo: {} ({kind}): {}", info.name, cli::chain(&e));
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
