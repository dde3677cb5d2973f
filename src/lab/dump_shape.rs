//! Checks a `/config_dump` document against a description of ztunnel's shape (the fixture
//! `tests/fixtures/ztunnel_config_dump.json`): for each kind of object the keys ztunnel always
//! writes (`required`), those it may leave out (`optional`) and those ztnode adds (`ztnode`).
//! Also the value shapes istioctl decodes: VIPs and workload services as strings, certificates
//! with base64 PEM, a decimal serial and RFC 3339 validity.

use serde_json::{Map, Value};

/// Every way `dump` departs from `fixture`, as readable lines (empty = same shape).
pub fn shape_errors(dump: &Value, fixture: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let mut keys = |what: &str, v: &Value| check_keys(&mut errs, what, v, &fixture[what]);
    keys("topLevel", dump);
    keys("version", &dump["version"]);
    keys("staticConfig", &dump["staticConfig"]);
    for w in items(&dump["workloads"]) {
        keys("workload", w);
    }
    for s in items(&dump["services"]) {
        keys("service", s);
        for e in s["endpoints"].as_object().into_iter().flat_map(Map::values) {
            keys("endpoint", e);
        }
    }
    for p in items(&dump["policies"]) {
        keys("policy", p);
    }
    for c in items(&dump["certificates"]) {
        keys("certificates", c);
        for cert in items(&c["certChain"]).chain(items(&c["rootCerts"])) {
            keys("cert", cert);
        }
    }
    for st in dump["workloadState"]
        .as_object()
        .into_iter()
        .flat_map(Map::values)
    {
        keys("workloadState", st);
        keys("workloadInfo", &st["info"]);
    }
    for w in items(&dump["workloads"]) {
        if !w["workloadIps"]
            .as_array()
            .is_some_and(|a| a.iter().all(Value::is_string))
        {
            errs.push(format!(
                "workload {}: workloadIps must be strings",
                w["name"]
            ));
        }
        if !w
            .get("services")
            .is_none_or(|s| s.as_array().is_some_and(|a| a.iter().all(Value::is_string)))
        {
            errs.push(format!(
                "workload {}: services must be a list of namespace/hostname",
                w["name"]
            ));
        }
    }
    for s in items(&dump["services"]) {
        if !s["vips"].as_array().is_some_and(|a| {
            a.iter()
                .all(|v| v.as_str().is_some_and(|v| v.contains('/')))
        }) {
            errs.push(format!(
                "service {}: vips must be network/ip strings",
                s["name"]
            ));
        }
    }
    for c in items(&dump["certificates"]) {
        for cert in items(&c["certChain"]).chain(items(&c["rootCerts"])) {
            errs.extend(cert_errors(cert));
        }
    }
    errs
}

fn items(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

fn check_keys(errs: &mut Vec<String>, what: &str, v: &Value, spec: &Value) {
    let Some(obj) = v.as_object() else {
        errs.push(format!("{what}: not an object: {v}"));
        return;
    };
    let list = |k: &str| -> Vec<&str> { items(&spec[k]).filter_map(Value::as_str).collect() };
    let (required, optional, ours) = (list("required"), list("optional"), list("ztnode"));
    for r in &required {
        if !obj.contains_key(*r) {
            errs.push(format!("{what}: missing {r}"));
        }
    }
    for k in obj.keys() {
        if ![&required, &optional, &ours]
            .iter()
            .any(|l| l.contains(&k.as_str()))
        {
            errs.push(format!("{what}: key {k} is not ztunnel's"));
        }
    }
}

fn cert_errors(cert: &Value) -> Vec<String> {
    use base64::Engine as _;
    let mut errs = Vec::new();
    let pem = cert["pem"]
        .as_str()
        .and_then(|p| base64::engine::general_purpose::STANDARD.decode(p).ok())
        .and_then(|b| String::from_utf8(b).ok());
    if !pem.is_some_and(|p| p.starts_with("-----BEGIN CERTIFICATE-----")) {
        errs.push(format!(
            "cert pem is not base64 of a PEM certificate: {}",
            cert["pem"]
        ));
    }
    if !cert["serialNumber"]
        .as_str()
        .is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
    {
        errs.push(format!(
            "cert serialNumber is not decimal: {}",
            cert["serialNumber"]
        ));
    }
    let t = |k: &str| {
        cert[k].as_str().and_then(|s| {
            time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()
        })
    };
    match (t("validFrom"), t("expirationTime")) {
        (Some(a), Some(b)) if a < b => {}
        _ => errs.push(format!(
            "cert validity is not two ordered RFC 3339 times: {} .. {}",
            cert["validFrom"], cert["expirationTime"]
        )),
    }
    errs
}
