//! CNI stdin: the network config (every key the plugin reads), its `prevResult` parsed at every
//! spec version, and `CNI_ARGS`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ztnode::plugin::netconf::{ConfHeader, K8sArgs, NetConf};
use ztnode::plugin::result::PrevResult;
use ztnode::plugin::version::CniVersion;

fuzz_target!(|data: &[u8]| {
    let _ = ConfHeader::sniff_version(data);
    if let Ok(header) = ConfHeader::parse(data)
        && let Ok(conf) = NetConf::from_header(header)
    {
        let _ = conf.is_excluded("kube-system");
        if let Some(prev) = &conf.prev_result {
            for version in CniVersion::ALL {
                if let Ok(prev) = PrevResult::parse(prev, version) {
                    let _ = prev.pod_ips();
                    for out in CniVersion::ALL {
                        let _ = prev.to_version(out);
                    }
                }
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let args = K8sArgs::parse(text);
        let _ = args.pod();
    }
});
