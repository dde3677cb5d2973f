//! Pure edits of CNI network config JSON: validity (kubelet/libcni view), inserting and removing
//! ztnode's plugin entry, and converting a single-plugin `.conf` to a `.conflist` and back.
//!
//! All functions work on `serde_json` values built with `preserve_order`, so keys we do not know keep
//! their place. Multus: its generated config (`00-multus.conf`, `"type": "multus"`) embeds the
//! cluster network's config in `delegates`, copied from the file that was primary when Multus
//! wrote it; when that copy holds our entry (chained before Multus came up) the plugin would run
//! twice per pod, once inside Multus's delegate and once after Multus. Removing our entries
//! therefore also removes them from every plugin's `delegates`, so the one entry left is ours at
//! the end of the primary. Istio's counterpart is `cni/pkg/install/cniconfig.go` (`../shared/spec/istio-cni.md`
//! §2.3–2.4); unlike Istio we keep the original `cniVersion`/`name` when converting a `.conf`.

use serde_json::{Map, Value};

/// `type` (and `name`) of ztnode's entry in a conflist; also the plugin binary's file name.
pub const PLUGIN_TYPE: &str = "ztnode-cni";
/// Key in our entry recording the `.conf` file name we converted into the list holding the entry, so
/// uninstall (possibly from a later process) can give the `.conf` back.
pub const CONVERTED_FROM_KEY: &str = "ztnode_converted_from";

const CONF_EXT: &str = ".conf";
const CONFLIST_EXT: &str = ".conflist";

/// How the runtime reads a config file that it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConfKind {
    /// `.conflist` with a non-empty `plugins` array of objects.
    List,
    /// `.conf` holding one plugin (top-level `type`).
    Single,
}

/// The settings written into our entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryParams {
    /// `cni_agent_run_dir`: where the plugin finds the agent's socket.
    pub run_dir: String,
    /// `exclude_namespaces`: pods the plugin lets through untouched.
    pub exclude_namespaces: Vec<String>,
    /// `plugin_log_level`, written only if set.
    pub log_level: Option<String>,
    /// Kubernetes mode's keys, written only in that mode.
    pub kube: Option<EntryKube>,
}

/// The entry keys of Kubernetes mode (read by `crate::plugin::netconf`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryKube {
    /// `kubeconfig`: path of the plugin's kubeconfig.
    pub kubeconfig: String,
    /// `ambient_enablement_selector`: the raw selector text, written only if set.
    pub enablement_selector: Option<String>,
    /// `ztnode_namespace`: the namespace of ztnode's own pods.
    pub namespace: String,
}

/// Whether `file_name` has a CNI config extension (`.conf` or `.conflist`).
pub(crate) fn has_conf_ext(file_name: &str) -> bool {
    file_name.ends_with(CONF_EXT) || file_name.ends_with(CONFLIST_EXT)
}

/// Classifies a parsed file as the runtime would: `None` for files it skips (not an object, a `.conf`
/// without a string `type`, a `.conflist` without plugins or with a non-object plugin, other names).
pub(crate) fn classify(file_name: &str, value: &Value) -> Option<ConfKind> {
    let obj = value.as_object()?;
    if file_name.ends_with(CONFLIST_EXT) {
        let plugins = obj.get("plugins")?.as_array()?;
        (!plugins.is_empty() && plugins.iter().all(Value::is_object)).then_some(ConfKind::List)
    } else if file_name.ends_with(CONF_EXT) {
        obj.get("type")?.as_str().map(|_| ConfKind::Single)
    } else {
        None
    }
}

/// Whether a plugin object is one of ours (`type == "ztnode-cni"`).
pub(crate) fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// Number of our entries in a list's `plugins` (0 for anything that is not a list).
pub(crate) fn count_ours(list: &Value) -> usize {
    plugins(list).map_or(0, |p| p.iter().filter(|p| is_ours(p)).count())
}

/// Number of our entries inside the `delegates` of the file's plugins (a `.conf`'s one plugin or a
/// list's `plugins`): Multus's embedded copies of the cluster network's config.
pub(crate) fn count_embedded(value: &Value) -> usize {
    let delegates = |plugin: &Value| -> usize {
        plugin
            .get("delegates")
            .and_then(Value::as_array)
            .map_or(0, |ds| {
                ds.iter()
                    .map(|d| usize::from(is_ours(d)) + count_ours(d))
                    .sum()
            })
    };
    match plugins(value) {
        Some(p) => p.iter().map(delegates).sum(),
        None => delegates(value),
    }
}

/// Whether a config (a `.conf`'s plugin or a list) runs a plugin of type `plugin_type`: itself, in
/// `plugins`, or in any plugin's `delegates` (Multus), one level down.
pub(crate) fn has_type(value: &Value, plugin_type: &str) -> bool {
    let is = |p: &Value| p.get("type").and_then(Value::as_str) == Some(plugin_type);
    let with_delegates = |p: &Value| {
        is(p)
            || p.get("delegates")
                .and_then(Value::as_array)
                .is_some_and(|ds| {
                    ds.iter()
                        .any(|d| is(d) || plugins(d).is_some_and(|ps| ps.iter().any(is)))
                })
    };
    match plugins(value) {
        Some(ps) => ps.iter().any(with_delegates),
        None => with_delegates(value),
    }
}

/// Removes our entries from `plugin`'s `delegates` (Multus): delegates that are our entry, and our
/// entries in delegated lists. Nothing else changes.
fn strip_delegates(plugin: &mut Value) {
    if let Some(ds) = plugin.get_mut("delegates").and_then(Value::as_array_mut) {
        ds.retain(|d| !is_ours(d));
        for d in ds {
            if let Some(p) = plugins_mut(d) {
                p.retain(|p| !is_ours(p));
            }
        }
    }
}

/// Returns a single-plugin `.conf` with our entries removed from its `delegates` (Multus).
pub(crate) fn conf_without_embedded(conf: &Value) -> Value {
    let mut out = conf.clone();
    strip_delegates(&mut out);
    out
}

/// `X.conflist` for `X.conf`; `None` if `conf_name` does not end in `.conf`.
pub(crate) fn conflist_name_for(conf_name: &str) -> Option<String> {
    conf_name
        .strip_suffix(CONF_EXT)
        .map(|stem| format!("{stem}{CONFLIST_EXT}"))
}

/// `X.conf` for `X.conflist`; `None` if `list_name` does not end in `.conflist`.
pub(crate) fn conf_name_for(list_name: &str) -> Option<String> {
    list_name
        .strip_suffix(CONFLIST_EXT)
        .map(|stem| format!("{stem}{CONF_EXT}"))
}

/// The `.conf` name recorded in our entry of `list` (read from file `list_name`), if it is exactly the
/// `.conf` sibling of `list_name` (anything else, e.g. a path, is ignored).
pub(crate) fn converted_from(list_name: &str, list: &Value) -> Option<String> {
    let sibling = conf_name_for(list_name)?;
    let recorded = plugins(list)?
        .iter()
        .filter(|p| is_ours(p))
        .find_map(|p| p.get(CONVERTED_FROM_KEY).and_then(Value::as_str))?;
    (recorded == sibling).then_some(sibling)
}

/// Builds our entry. No `cniVersion`: the list's version governs (as Istio strips it).
pub(crate) fn our_entry(params: &EntryParams, converted_from: Option<&str>) -> Value {
    let mut entry = Map::new();
    entry.insert("type".into(), PLUGIN_TYPE.into());
    entry.insert("name".into(), PLUGIN_TYPE.into());
    entry.insert("cni_agent_run_dir".into(), params.run_dir.clone().into());
    entry.insert(
        "exclude_namespaces".into(),
        params.exclude_namespaces.clone().into(),
    );
    if let Some(level) = &params.log_level {
        entry.insert("plugin_log_level".into(), level.clone().into());
    }
    if let Some(kube) = &params.kube {
        entry.insert("kubeconfig".into(), kube.kubeconfig.clone().into());
        if let Some(selector) = &kube.enablement_selector {
            entry.insert(
                "ambient_enablement_selector".into(),
                selector.clone().into(),
            );
        }
        entry.insert("ztnode_namespace".into(), kube.namespace.clone().into());
    }
    if let Some(conf) = converted_from {
        entry.insert(CONVERTED_FROM_KEY.into(), conf.into());
    }
    Value::Object(entry)
}

/// Returns `list` with every entry of ours removed and `entry` appended last; everything else keeps
/// its value and order. `None` if `list` has no `plugins` array.
pub(crate) fn with_entry(list: &Value, entry: Value) -> Option<Value> {
    let mut out = without_entries(list)?;
    plugins_mut(&mut out)?.push(entry);
    Some(out)
}

/// Returns `list` with every entry of ours removed, also those inside its plugins' `delegates`
/// (Multus). `None` if `list` has no `plugins` array.
pub(crate) fn without_entries(list: &Value) -> Option<Value> {
    let mut out = list.clone();
    let plugins = plugins_mut(&mut out)?;
    plugins.retain(|p| !is_ours(p));
    plugins.iter_mut().for_each(strip_delegates);
    Some(out)
}

/// Turns a single-plugin `.conf` into a list `{cniVersion, name, plugins: [conf minus cniVersion,
/// entry]}`. The list takes the conf's `cniVersion` and `name` (each only if present); the plugin keeps
/// its `name` (as in Istio's `bridge.conf.golden`); our entries in its `delegates` (Multus) are
/// removed. `None` if `conf` is not an object.
pub(crate) fn conf_to_list(conf: &Value, entry: Value) -> Option<Value> {
    let mut plugin = conf_without_embedded(conf).as_object()?.clone();
    let version = plugin.shift_remove("cniVersion");
    let mut list = Map::new();
    if let Some(version) = version {
        list.insert("cniVersion".into(), version);
    }
    if let Some(name) = plugin.get("name") {
        list.insert("name".into(), name.clone());
    }
    list.insert(
        "plugins".into(),
        Value::Array(vec![Value::Object(plugin), entry]),
    );
    Some(Value::Object(list))
}

/// Inverse of [`conf_to_list`] for a list whose entries of ours were already removed: the single
/// remaining plugin with the list's `cniVersion` put first (and the list's `name` if the plugin lost
/// its own). `None` unless exactly one plugin object remains.
pub(crate) fn list_to_conf(list: &Value) -> Option<Value> {
    let obj = list.as_object()?;
    let [Value::Object(plugin)] = obj.get("plugins")?.as_array()?.as_slice() else {
        return None;
    };
    let mut conf = Map::new();
    if !plugin.contains_key("cniVersion")
        && let Some(version) = obj.get("cniVersion")
    {
        conf.insert("cniVersion".into(), version.clone());
    }
    if !plugin.contains_key("name")
        && let Some(name) = obj.get("name")
    {
        conf.insert("name".into(), name.clone());
    }
    conf.extend(plugin.iter().map(|(k, v)| (k.clone(), v.clone())));
    Some(Value::Object(conf))
}

/// Renders a config as written to disk: 2-space indented JSON and a trailing newline.
pub(crate) fn render(value: &Value) -> Result<String, serde_json::Error> {
    let mut out = serde_json::to_string_pretty(value)?;
    out.push('\n');
    Ok(out)
}

fn plugins(list: &Value) -> Option<&Vec<Value>> {
    list.get("plugins")?.as_array()
}

fn plugins_mut(list: &mut Value) -> Option<&mut Vec<Value>> {
    list.get_mut("plugins")?.as_array_mut()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params() -> EntryParams {
        EntryParams {
            run_dir: "/var/run/ztnode".into(),
            exclude_namespaces: vec!["kube-system".into()],
            log_level: None,
            kube: None,
        }
    }

    fn keys(v: &Value) -> Vec<&str> {
        v.as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default()
    }

    #[test]
    fn classify_follows_runtime_rules() {
        let list = json!({"name": "n", "plugins": [{"type": "ptp"}]});
        assert_eq!(classify("a.conflist", &list), Some(ConfKind::List));
        assert_eq!(classify("a.conflist", &json!({})), None);
        assert_eq!(classify("a.conflist", &json!([])), None);
        assert_eq!(classify("a.conflist", &json!({"plugins": []})), None);
        assert_eq!(classify("a.conflist", &json!({"plugins": [1]})), None);
        assert_eq!(classify("a.conflist", &json!({"type": "bridge"})), None);
        assert_eq!(
            classify("a.conf", &json!({"type": "bridge"})),
            Some(ConfKind::Single)
        );
        assert_eq!(classify("a.conf", &list), None);
        assert_eq!(classify("a.json", &json!({"type": "bridge"})), None);
    }

    #[test]
    fn entry_has_no_version_and_optional_keys() {
        let e = our_entry(&params(), None);
        assert_eq!(
            keys(&e),
            ["type", "name", "cni_agent_run_dir", "exclude_namespaces"]
        );
        let p = EntryParams {
            log_level: Some("debug".into()),
            ..params()
        };
        let e = our_entry(&p, Some("x.conf"));
        assert_eq!(e["plugin_log_level"], "debug");
        assert_eq!(e[CONVERTED_FROM_KEY], "x.conf");
        assert!(e.get("cniVersion").is_none());
    }

    #[test]
    fn kube_keys_only_in_kubernetes_mode() {
        let kube = |selector: Option<&str>| EntryParams {
            kube: Some(EntryKube {
                kubeconfig: "/var/run/ztnode/ztnode-cni-kubeconfig".into(),
                enablement_selector: selector.map(str::to_owned),
                namespace: "ztnode-system".into(),
            }),
            ..params()
        };
        let e = our_entry(&kube(None), None);
        assert_eq!(
            keys(&e),
            [
                "type",
                "name",
                "cni_agent_run_dir",
                "exclude_namespaces",
                "kubeconfig",
                "ztnode_namespace"
            ]
        );
        assert_eq!(e["kubeconfig"], "/var/run/ztnode/ztnode-cni-kubeconfig");
        assert_eq!(e["ztnode_namespace"], "ztnode-system");
        let e = our_entry(&kube(Some("- podSelector: {}\n")), None);
        assert_eq!(e["ambient_enablement_selector"], "- podSelector: {}\n");
        let e = our_entry(&kube(Some("")), None);
        assert_eq!(
            e["ambient_enablement_selector"], "",
            "set but empty is kept: it enrolls nothing"
        );
    }

    #[test]
    fn with_entry_appends_last_and_replaces_duplicates() {
        let list = json!({
            "cniVersion": "1.1.0", "name": "n", "vendor": {"k": 1},
            "plugins": [{"type": PLUGIN_TYPE, "old": 1}, {"type": "ptp", "x": 2}, {"type": PLUGIN_TYPE}]
        });
        let out = with_entry(&list, our_entry(&params(), None)).unwrap();
        assert_eq!(keys(&out), ["cniVersion", "name", "vendor", "plugins"]);
        assert_eq!(out["cniVersion"], "1.1.0");
        assert_eq!(out["plugins"][0], json!({"type": "ptp", "x": 2}));
        assert_eq!(out["plugins"][1], our_entry(&params(), None));
        assert_eq!(count_ours(&out), 1);
        assert_eq!(out["plugins"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn with_entry_is_idempotent() {
        let list = json!({"name": "n", "plugins": [{"type": "ptp"}]});
        let once = with_entry(&list, our_entry(&params(), None)).unwrap();
        let twice = with_entry(&once, our_entry(&params(), None)).unwrap();
        assert_eq!(render(&once).unwrap(), render(&twice).unwrap());
    }

    #[test]
    fn without_entries_restores_original() {
        let list = json!({"name": "n", "plugins": [{"type": "ptp"}, {"type": "portmap"}]});
        let chained = with_entry(&list, our_entry(&params(), None)).unwrap();
        assert_eq!(without_entries(&chained).unwrap(), list);
        assert!(without_entries(&json!({"type": "bridge"})).is_none());
    }

    #[test]
    fn conf_round_trips_through_list() {
        let conf = json!({"cniVersion": "0.4.0", "name": "dbnet", "type": "bridge", "ipam": {"type": "host-local"}});
        let list = conf_to_list(&conf, our_entry(&params(), Some("b.conf"))).unwrap();
        assert_eq!(keys(&list), ["cniVersion", "name", "plugins"]);
        assert_eq!(list["cniVersion"], "0.4.0");
        assert_eq!(list["name"], "dbnet");
        assert_eq!(keys(&list["plugins"][0]), ["name", "type", "ipam"]);
        assert_eq!(
            converted_from("b.conflist", &list).as_deref(),
            Some("b.conf")
        );
        let back = list_to_conf(&without_entries(&list).unwrap()).unwrap();
        assert_eq!(keys(&back), keys(&conf));
        assert_eq!(back, conf);
    }

    /// Multus's generated config as written after ztnode had chained into the cluster network's
    /// list: the delegate carries our entry.
    fn multus_embedding_ours() -> Value {
        json!({
            "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus",
            "delegates": [{"cniVersion": "0.3.1", "name": "cbr0", "plugins": [
                {"type": "flannel"}, {"type": "portmap"}, {"type": PLUGIN_TYPE, "cni_agent_run_dir": "/x"}
            ]}]
        })
    }

    #[test]
    fn multus_delegates_lose_our_entry() {
        let conf = multus_embedding_ours();
        assert_eq!(count_embedded(&conf), 1);
        let list = conf_to_list(&conf, our_entry(&params(), Some("00-multus.conf"))).unwrap();
        assert_eq!(count_ours(&list), 1, "ours once, after multus");
        assert_eq!(count_embedded(&list), 0, "not inside multus's delegate");
        assert_eq!(
            list["plugins"][0]["delegates"][0]["plugins"],
            json!([{"type": "flannel"}, {"type": "portmap"}])
        );
        let as_list = json!({"name": "m", "plugins": [multus_embedding_ours()]});
        assert_eq!(count_embedded(&as_list), 1);
        let chained = with_entry(&as_list, our_entry(&params(), None)).unwrap();
        assert_eq!((count_ours(&chained), count_embedded(&chained)), (1, 0));
        let single_delegate =
            json!({"type": "multus", "delegates": [{"type": PLUGIN_TYPE}, {"type": "bridge"}]});
        assert_eq!(count_embedded(&single_delegate), 1);
        assert_eq!(
            conf_without_embedded(&single_delegate),
            json!({"type": "multus", "delegates": [{"type": "bridge"}]})
        );
    }

    #[test]
    fn has_type_looks_into_lists_and_delegates() {
        assert!(has_type(&json!({"type": "istio-cni"}), "istio-cni"));
        assert!(has_type(
            &json!({"plugins": [{"type": "ptp"}, {"type": "istio-cni"}]}),
            "istio-cni"
        ));
        assert!(has_type(
            &json!({"type": "multus", "delegates": [{"plugins": [{"type": "istio-cni"}]}]}),
            "istio-cni"
        ));
        assert!(!has_type(
            &json!({"plugins": [{"type": "ptp", "name": "istio-cni"}]}),
            "istio-cni"
        ));
        assert!(!has_type(&json!({"type": "bridge"}), "istio-cni"));
    }

    #[test]
    fn list_to_conf_needs_exactly_one_plugin() {
        let two = json!({"cniVersion": "0.4.0", "plugins": [{"type": "a"}, {"type": "b"}]});
        assert!(list_to_conf(&two).is_none());
        let one = json!({"cniVersion": "0.4.0", "name": "n", "plugins": [{"type": "a"}]});
        assert_eq!(
            list_to_conf(&one).unwrap(),
            json!({"cniVersion": "0.4.0", "name": "n", "type": "a"})
        );
    }

    #[test]
    fn converted_from_only_accepts_the_sibling() {
        let entry = |from: &str| json!({"plugins": [{"type": "a"}, {"type": PLUGIN_TYPE, CONVERTED_FROM_KEY: from}]});
        assert_eq!(
            converted_from("x.conflist", &entry("x.conf")).as_deref(),
            Some("x.conf")
        );
        assert_eq!(converted_from("x.conflist", &entry("../etc/x.conf")), None);
        assert_eq!(converted_from("x.conflist", &entry("y.conf")), None);
        assert_eq!(converted_from("x.conf", &entry("x.conf")), None);
    }

    #[test]
    fn render_is_two_space_with_newline() {
        let s = render(&json!({"a": [1], "b": {}})).unwrap();
        assert_eq!(s, "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}\n");
    }

    #[test]
    fn sibling_names() {
        assert_eq!(
            conflist_name_for("10-a.conf").as_deref(),
            Some("10-a.conflist")
        );
        assert_eq!(conf_name_for("10-a.conflist").as_deref(), Some("10-a.conf"));
        assert_eq!(conflist_name_for("10-a.conflist"), None);
        assert!(has_conf_ext("a.conf") && has_conf_ext("a.conflist") && !has_conf_ext("a.json"));
    }
}
