//! A second "host" for the soft-device tests: a network namespace joined
//! to this one by a veth pair, removed on drop, with the link cut or made
//! lossy with nftables (the kernel here has no netem). Needs root and
//! iproute2 (and `nft` for loss); where one is missing the caller reports
//! itself skipped with the reason [`Netns::create`] or
//! [`Netns::drop_randomly`] gives.

use std::net::Ipv4Addr;
use std::process::Command;

/// Runs a command; its stderr on failure.
fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("`{cmd}` not runnable: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

/// A network namespace and the veth pair into it; removed on drop.
pub struct Netns {
    /// The namespace's name.
    pub name: String,
    /// This namespace's end of the veth pair.
    pub veth: String,
    /// The address of this end.
    pub host_ip: Ipv4Addr,
    /// The address of the namespace's end.
    pub peer_ip: Ipv4Addr,
}

impl Netns {
    /// Creates namespace `verbio-<group>-<pid>-<tag>` with a veth to it:
    /// 10.`net`.N.1 here, 10.`net`.N.2 there (`net` tells apart the test
    /// binaries, `tag` the tests of one binary, below 10).
    pub fn create(group: &str, net: u8, tag: u8) -> Result<Netns, String> {
        let pid = std::process::id();
        let n = ((pid % 25) as u8) * 10 + tag;
        let ns = Netns {
            name: format!("verbio-{group}-{pid}-{tag}"),
            veth: format!("v{}{}t{tag}", &group[..1], pid % 100_000),
            host_ip: Ipv4Addr::new(10, net, n, 1),
            peer_ip: Ipv4Addr::new(10, net, n, 2),
        };
        let peer_end = format!("{}p", ns.veth);
        let host_cidr = format!("{}/24", ns.host_ip);
        let peer_cidr = format!("{}/24", ns.peer_ip);
        ip(&["netns", "add", &ns.name])?;
        // `ns` exists already: an early return drops it, removing what was made.
        ip(&[
            "link", "add", &ns.veth, "type", "veth", "peer", "name", &peer_end,
        ])?;
        ip(&["link", "set", &peer_end, "netns", &ns.name])?;
        ip(&["addr", "add", &host_cidr, "dev", &ns.veth])?;
        ip(&["link", "set", &ns.veth, "up"])?;
        ns.inside("ip", &["addr", "add", &peer_cidr, "dev", &peer_end])?;
        ns.inside("ip", &["link", "set", &peer_end, "up"])?;
        ns.inside("ip", &["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Runs `cmd ARGS` inside the namespace.
    pub fn inside(&self, cmd: &str, args: &[&str]) -> Result<(), String> {
        let mut all = vec!["netns", "exec", &self.name, cmd];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Cuts the link (the host end goes down: packets are dropped, no
    /// reset reaches either side).
    pub fn cut(&self) {
        ip(&["link", "set", &self.veth, "down"]).expect("link down");
    }

    /// Drops `percent`% of the packets crossing the namespace's end of the
    /// link, each way, at random (nftables in the namespace; 100 = the
    /// peer host vanished: nothing passes, nothing is reset). Replaces an
    /// earlier rate. The link stops segmenting in large chunks first
    /// (`gso_max_segs 1`), so that a share of the packets is a share of
    /// the MTU-sized segments a link loses, not of 64 KiB chunks.
    pub fn drop_randomly(&self, percent: u8) -> Result<(), String> {
        let dev = format!("{}p", self.veth);
        let small = ["gso_max_size", "1500", "gso_max_segs", "1"];
        let mut here = vec!["link", "set", "dev", &self.veth];
        here.extend(small);
        ip(&here)?;
        let mut there = vec!["link", "set", "dev", &dev];
        there.extend(small);
        self.inside("ip", &there)?;
        let _ = self.inside("nft", &["delete", "table", "inet", "verbio_loss"]);
        self.inside("nft", &["add", "table", "inet", "verbio_loss"])?;
        for (chain, hook, dir) in [("in", "input", "iifname"), ("out", "output", "oifname")] {
            let spec = format!("{{ type filter hook {hook} priority 0 ; }}");
            self.inside(
                "nft",
                &["add", "chain", "inet", "verbio_loss", chain, &spec],
            )?;
            let rule = if percent >= 100 {
                format!("{dir} \"{dev}\" drop")
            } else {
                format!("{dir} \"{dev}\" numgen random mod 100 < {percent} drop")
            };
            let mut args = vec!["add", "rule", "inet", "verbio_loss", chain];
            args.extend(rule.split(' '));
            self.inside("nft", &args)?;
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
