//! The bench's sections ([`super::Section`]): each measures on the [`Bed`] and adds its figures.

use std::time::Duration;

use super::measure::{self, conn_rate, cpu_seconds, idle_connections, interleaved, iperf};
use super::options::BenchOptions;
use super::placement::{Placement, PollingIdle};
use super::report::{Figures, Row, Value};
use super::setup::{Bed, Enrolled};

/// iperf3 throughput of 1 and 8 streams on both paths, and the node's CPU time per GB carried.
pub(super) fn throughput(bed: &Bed, secs: u64, figures: &mut Figures) -> anyhow::Result<()> {
    let [d_client, d_server, m_client, m_server] = bed.pods();
    let pid = bed.pid();
    for streams in [1usize, 8] {
        let (mut mesh_bytes, mut cpu) = (0.0, 0.0);
        let (direct, mesh_v) = interleaved(
            secs,
            |slice| Ok(iperf(d_client, d_server, streams, slice)?.0),
            |slice| {
                let cpu_before = cpu_seconds(pid)?;
                let (gbps, bytes) = iperf(m_client, m_server, streams, slice)?;
                cpu += cpu_seconds(pid)? - cpu_before;
                mesh_bytes += bytes;
                Ok(gbps)
            },
        )?;
        figures.rows.push(Row::new(
            format!("throughput {streams} stream(s)"),
            "Gbit/s",
            direct,
            mesh_v,
        ));
        figures.values.push(Value::new(
            &format!("ztnode CPU per GB, {streams} stream(s) (ms)"),
            if streams == 1 {
                "cpu_ms_per_gb_1_stream"
            } else {
                "cpu_ms_per_gb_8_streams"
            },
            if mesh_bytes > 0.0 {
                cpu * 1e3 / (mesh_bytes / 1e9)
            } else {
                0.0
            },
            0,
        ));
    }
    Ok(())
}

/// 1 KiB round trips (p50, p99) on both paths, in each [`Placement`] this machine allows, and the
/// RTT the mesh adds.
pub(super) fn latency(bed: &Bed, round_trips: usize, figures: &mut Figures) -> anyhow::Result<()> {
    let mut placements = vec![Placement::Free, Placement::OneCpu];
    match PollingIdle::check() {
        Ok(()) => placements.push(Placement::PollingIdle),
        Err(e) => eprintln!("bench: {e:#}; the polling-idle latency rows are left out"),
    }
    let [d_client, d_server, m_client, m_server] = bed.pods();
    for (i, placement) in placements.into_iter().enumerate() {
        let l = measure::latency(
            [d_client, d_server, m_client, m_server],
            round_trips,
            7100 + 10 * i as u16,
            placement,
            bed.pid(),
        )?;
        let (what, key) = placement.label();
        figures.rows.push(Row::new(
            format!("1 KiB round trip p50{what}"),
            "µs",
            l.direct_p50,
            l.mesh_p50,
        ));
        figures.rows.push(Row::new(
            format!("1 KiB round trip p99{what}"),
            "µs",
            l.direct_p99,
            l.mesh_p99,
        ));
        figures.values.push(Value::new(
            &format!("added RTT p50{what} (µs)"),
            &format!("added_rtt_p50{key}_us"),
            l.mesh_p50 - l.direct_p50,
            2,
        ));
        figures.values.push(Value::new(
            &format!("added RTT p99{what} (µs)"),
            &format!("added_rtt_p99{key}_us"),
            l.mesh_p99 - l.direct_p99,
            2,
        ));
    }
    Ok(())
}

/// New connection + 1 KiB round trip + close per second on both paths.
pub(super) fn rate(bed: &Bed, secs: u64, figures: &mut Figures) -> anyhow::Result<()> {
    let [d_client, d_server, m_client, m_server] = bed.pods();
    let (dc, mc) = interleaved(
        secs,
        |slice| conn_rate(d_client, d_server, Duration::from_secs(slice)),
        |slice| conn_rate(m_client, m_server, Duration::from_secs(slice)),
    )?;
    figures.rows.push(Row::new(
        "connect + 1 KiB RTT + close".into(),
        "conn/s",
        dc,
        mc,
    ));
    Ok(())
}

/// The node's RSS: idle with 2 and with `--pods` pods ([`Enrolled`]), with each batch of idle
/// connections held, per idle connection, and after they closed.
pub(super) fn memory(
    bed: &Bed,
    opts: &BenchOptions,
    enrolled: &Enrolled,
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let mib = |kib: u64| kib as f64 / 1024.0;
    let [_, _, m_client, m_server] = bed.pods();
    let idle = idle_connections(m_client, m_server, opts.idle_conns, bed.pid())?;
    let values = &mut figures.values;
    values.push(Value::new(
        "RSS idle, 2 pods (MiB)",
        "rss_idle_2_pods_mib",
        mib(enrolled.rss_2),
        1,
    ));
    values.push(Value::new(
        &format!("RSS idle, {} pods (MiB)", opts.pods),
        "rss_idle_pods_mib",
        mib(enrolled.rss_n),
        1,
    ));
    for (i, rss) in idle.held.iter().enumerate() {
        values.push(Value::new(
            &format!("RSS, {} idle conns (MiB)", (i + 1) * opts.idle_conns),
            &match i {
                0 => "rss_idle_conns_mib".to_owned(),
                i => format!("rss_{}x_idle_conns_mib", i + 1),
            },
            mib(*rss),
            1,
        ));
    }
    values.push(Value::new(
        "per idle connection (KiB)",
        "per_idle_conn_kib",
        idle.per_conn(opts.idle_conns),
        2,
    ));
    values.push(Value::new(
        "RSS after they closed (MiB)",
        "rss_after_close_mib",
        mib(idle.after),
        1,
    ));
    Ok(())
}

/// Exec time of `ztnode-cni` (p50, p99) and of the whole chain (p50) in the extra pods' CNI ADD.
pub(super) fn cni(enrolled: &Enrolled, figures: &mut Figures) {
    let (plugin_ms, chain_ms) = (&enrolled.plugin_ms, &enrolled.chain_ms);
    figures.values.push(Value::new(
        "ztnode-cni ADD p50 (ms)",
        "ztnode_cni_add_p50_ms",
        measure::percentile(plugin_ms, 0.5),
        2,
    ));
    figures.values.push(Value::new(
        "ztnode-cni ADD p99 (ms)",
        "ztnode_cni_add_p99_ms",
        measure::percentile(plugin_ms, 0.99),
        2,
    ));
    figures.values.push(Value::new(
        "whole chain ADD p50 (ms)",
        "chain_add_p50_ms",
        measure::percentile(chain_ms, 0.5),
        2,
    ));
}
