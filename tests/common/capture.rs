//! "No plaintext on the bridge": a tcpdump of a lab's bridge, checked once the test's traffic is done.
#![allow(dead_code)]

use std::net::IpAddr;
use std::path::PathBuf;

use ztnode::lab::pcap::{self, TcpSegment};
use ztnode::lab::{Lab, ProcessGuard};

/// A running capture of every TCP segment on the lab's bridge (stopped by [`BridgeCapture::check`]
/// or when dropped).
pub struct BridgeCapture {
    dump: Option<ProcessGuard>,
    path: PathBuf,
}

impl BridgeCapture {
    /// Starts tcpdump on `lab`'s bridge, writing `<lab dir>/<name>.pcap`; returns once it listens.
    pub fn start(lab: &Lab, name: &str) -> BridgeCapture {
        let path = lab.dir().join(format!("{name}.pcap"));
        let dump = lab.capture(&path).expect("tcpdump on the bridge");
        BridgeCapture {
            dump: Some(dump),
            path,
        }
    }

    /// Stops the capture and checks it: it saw HBONE (port 15008) between two addresses of `mesh`
    /// (the enrolled pods), every segment between them is on that port, and no segment at all (to
    /// or from anyone) carries one of `secrets` (payloads the test sent between mesh pods).
    /// Returns the segments.
    #[track_caller]
    pub fn check(mut self, mesh: &[IpAddr], secrets: &[&[u8]]) -> Vec<TcpSegment> {
        drop(self.dump.take());
        let data = std::fs::read(&self.path).expect("read pcap");
        let segs = pcap::tcp_segments(&data).expect("parse pcap");
        for s in &segs {
            let between_mesh = mesh.contains(&s.src) && mesh.contains(&s.dst);
            assert!(
                !between_mesh || s.src_port == 15008 || s.dst_port == 15008,
                "plaintext between mesh pods: {}:{} -> {}:{}",
                s.src,
                s.src_port,
                s.dst,
                s.dst_port
            );
            for secret in secrets {
                assert!(
                    !pcap::contains(&s.payload, secret),
                    "{:?} crossed the bridge in plaintext ({}:{} -> {}:{})",
                    String::from_utf8_lossy(secret),
                    s.src,
                    s.src_port,
                    s.dst,
                    s.dst_port
                );
            }
        }
        assert!(
            segs.iter().any(|s| mesh.contains(&s.src)
                && mesh.contains(&s.dst)
                && (s.src_port == 15008 || s.dst_port == 15008)),
            "the capture saw no HBONE between the mesh pods ({} segments)",
            segs.len()
        );
        segs
    }
}
