//! The lab builds a real node: reference bridge + host-local plugins, two pods that can talk.

mod common;

use std::io::{Read, Write};

use ztnode::lab::{Lab, LabOptions};

#[test]
fn pods_on_the_lab_bridge_reach_each_other() {
    if !common::privileged("pods_on_the_lab_bridge_reach_each_other") {
        return;
    }
    let lab = Lab::new(LabOptions {
        prefix: common::prefix("lb"),
        ztnode_binary: None,
        run_dir: "/nonexistent".into(),
        subnet: "10.77.0.0/24".into(),
        cni_version: "1.0.0".into(),
    })
    .expect("lab");
    let a = lab.add_pod("a", "default").expect("pod a");
    let b = lab.add_pod("b", "default").expect("pod b");
    assert_ne!(a.ip, b.ip);
    let b_ns = ztnode::netns::Netns::open(&b.netns_path).expect("b netns");
    let a_ns = ztnode::netns::Netns::open(&a.netns_path).expect("a netns");
    let listener = b_ns
        .run(|| std::net::TcpListener::bind((b.ip, 7000)))
        .expect("run")
        .expect("bind in b");
    let server = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().expect("accept");
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).expect("read");
        (buf, peer.ip())
    });
    let mut c = a_ns
        .run(|| std::net::TcpStream::connect((b.ip, 7000)))
        .expect("run")
        .expect("connect from a");
    c.write_all(b"hello").expect("write");
    let (got, peer) = server.join().expect("server");
    assert_eq!(&got, b"hello");
    assert_eq!(peer, a.ip);
    lab.del_pod(&a).expect("del a");
    lab.del_pod(&b).expect("del b");
}
