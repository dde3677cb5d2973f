//! Minimal reader for classic pcap files (as written by `tcpdump -w`), enough to check what crossed a
//! bridge: Ethernet (or Linux cooked) frames carrying IPv4/IPv6 TCP segments.

use std::net::IpAddr;

/// A TCP segment seen in a capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSegment {
    /// Source address.
    pub src: IpAddr,
    /// Source port.
    pub src_port: u16,
    /// Destination address.
    pub dst: IpAddr,
    /// Destination port.
    pub dst_port: u16,
    /// TCP payload.
    pub payload: Vec<u8>,
}

/// Errors reading a capture.
#[derive(Debug, thiserror::Error)]
pub enum PcapError {
    /// Not a pcap file (bad magic) or truncated header.
    #[error("not a pcap file")]
    BadHeader,
    /// A link type this reader does not handle.
    #[error("unsupported link type {0}")]
    LinkType(u32),
}

/// Parses all TCP segments of a pcap file. Truncated trailing records are ignored.
pub fn tcp_segments(data: &[u8]) -> Result<Vec<TcpSegment>, PcapError> {
    if data.len() < 24 {
        return Err(PcapError::BadHeader);
    }
    let magic = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
    let le = match magic {
        0xa1b2_c3d4 | 0xa1b2_3c4d => true,
        0xd4c3_b2a1 | 0x4d3c_b2a1 => false,
        _ => return Err(PcapError::BadHeader),
    };
    let u32_at = |b: &[u8], i: usize| -> u32 {
        let a = [b[i], b[i + 1], b[i + 2], b[i + 3]];
        if le {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let link = u32_at(data, 20);
    let l2 = match link {
        1 => 14,   // Ethernet
        113 => 16, // Linux cooked v1
        _ => return Err(PcapError::LinkType(link)),
    };
    let mut out = Vec::new();
    let mut off = 24;
    while off + 16 <= data.len() {
        let caplen = u32_at(data, off + 8) as usize;
        let start = off + 16;
        let end = start + caplen;
        if end > data.len() {
            break;
        }
        if let Some(seg) = parse_frame(&data[start..end], l2) {
            out.push(seg);
        }
        off = end;
    }
    Ok(out)
}

fn parse_frame(frame: &[u8], l2: usize) -> Option<TcpSegment> {
    let ethertype = u16::from_be_bytes([*frame.get(l2 - 2)?, *frame.get(l2 - 1)?]);
    let ip = frame.get(l2..)?;
    let (src, dst, proto, l4) = match ethertype {
        0x0800 => {
            let ihl = (ip.first()? & 0x0f) as usize * 4;
            let total = u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]) as usize;
            let src: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
            let dst: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            (
                IpAddr::from(src),
                IpAddr::from(dst),
                *ip.get(9)?,
                ip.get(ihl..total.min(ip.len()))?,
            )
        }
        0x86dd => {
            let plen = u16::from_be_bytes([*ip.get(4)?, *ip.get(5)?]) as usize;
            let src: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
            let dst: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            (
                IpAddr::from(src),
                IpAddr::from(dst),
                *ip.get(6)?,
                ip.get(40..(40 + plen).min(ip.len()))?,
            )
        }
        _ => return None,
    };
    if proto != 6 {
        return None;
    }
    let doff = ((l4.get(12)? >> 4) as usize) * 4;
    Some(TcpSegment {
        src,
        src_port: u16::from_be_bytes([*l4.first()?, *l4.get(1)?]),
        dst,
        dst_port: u16::from_be_bytes([*l4.get(2)?, *l4.get(3)?]),
        payload: l4.get(doff..)?.to_vec(),
    })
}

/// Whether `needle` occurs in `hay`.
pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_ethernet_ipv4_tcp_record() {
        let mut f = Vec::new();
        f.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
        f.extend_from_slice(&[2, 0, 4, 0]);
        f.extend_from_slice(&[0; 8]);
        f.extend_from_slice(&65535u32.to_le_bytes());
        f.extend_from_slice(&1u32.to_le_bytes());
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&[0x08, 0x00]);
        let payload = b"hi";
        let mut ip = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, 6, 0, 0, 10, 0, 0, 2, 10, 0, 0, 3,
        ];
        let total = (20 + 20 + payload.len()) as u16;
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&15008u16.to_be_bytes());
        tcp[12] = 5 << 4;
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&tcp);
        frame.extend_from_slice(payload);
        f.extend_from_slice(&[0; 8]);
        f.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        f.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        f.extend_from_slice(&frame);
        let segs = tcp_segments(&f).expect("parse");
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0].dst_port, 15008);
        assert_eq!(segs[0].payload, b"hi");
        assert!(contains(&segs[0].payload, b"hi"));
        assert!(tcp_segments(b"garbage").is_err());
    }
}
