//! The local config (`LOCAL_XDS_PATH` YAML: workloads, services, policies) into a proxy state.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ztnode::proxy::config::parse_local_config;
use ztnode::proxy::state::ProxyState;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(cfg) = parse_local_config(text) {
        let _ = ProxyState::from_config(&cfg);
        let _ = ProxyState::from_config_lenient(&cfg);
    }
});
