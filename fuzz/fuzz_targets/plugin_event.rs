//! The plugin's event bodies (`POST /cmdadd`, `/cmddel` on the agent's socket).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ztnode::podevent::{PodAddEvent, PodDelEvent};

fuzz_target!(|data: &[u8]| {
    if let Ok(ev) = serde_json::from_slice::<PodAddEvent>(data) {
        let back = serde_json::to_vec(&ev).expect("an event encodes");
        let again: PodAddEvent = serde_json::from_slice(&back).expect("and decodes back");
        assert_eq!(again, ev);
    }
    if let Ok(ev) = serde_json::from_slice::<PodDelEvent>(data) {
        let back = serde_json::to_vec(&ev).expect("an event encodes");
        let again: PodDelEvent = serde_json::from_slice(&back).expect("and decodes back");
        assert_eq!(again, ev);
    }
});
