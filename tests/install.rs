//! Installer acceptance tests: chaining into real primary-CNI configs and Istio's installer goldens
//! (read in place from `../shared/testdata`), `.conf` conversion, binary copy, uninstall, and the
//! watch/repair loop. Everything runs in temp dirs.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use tempfile::TempDir;
use ztnode::agent::install::{
    self, CONVERTED_FROM_KEY, InstallConfig, InstallError, PLUGIN_BINARY_NAME, PLUGIN_TYPE,
};

const REAL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/real-conflists"
);
const ISTIO: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/testdata/istio-install"
);

/// A node in temp dirs: bin dir, conf dir and a fake plugin binary to install.
struct Node {
    _tmp: TempDir,
    cfg: InstallConfig,
}

impl Node {
    fn new() -> Result<Node> {
        let tmp = tempfile::tempdir()?;
        let (bin, conf) = (tmp.path().join("bin"), tmp.path().join("net.d"));
        fs::create_dir(&bin)?;
        fs::create_dir(&conf)?;
        let source = tmp.path().join("ztnode");
        fs::write(&source, b"\x7fELF fake ztnode binary\n".repeat(5000))?;
        fs::set_permissions(&source, fs::Permissions::from_mode(0o700))?;
        let mut cfg = InstallConfig::new(source, "/var/run/ztnode".into());
        cfg.cni_bin_dir = bin;
        cfg.cni_conf_dir = conf;
        Ok(Node { _tmp: tmp, cfg })
    }

    fn conf(&self, name: &str) -> PathBuf {
        self.cfg.cni_conf_dir.join(name)
    }

    fn put(&self, name: &str, content: &[u8]) -> Result<()> {
        fs::write(self.conf(name), content)?;
        Ok(())
    }

    fn copy_in(&self, src: &Path, name: &str) -> Result<Vec<u8>> {
        let bytes = fs::read(src).with_context(|| format!("read {}", src.display()))?;
        self.put(name, &bytes)?;
        Ok(bytes)
    }

    fn json(&self, name: &str) -> Result<Value> {
        let bytes = fs::read(self.conf(name)).with_context(|| name.to_owned())?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    fn names(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = fs::read_dir(&self.cfg.cni_conf_dir)?
            .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_>>()?;
        names.sort();
        Ok(names)
    }
}

fn plugins(list: &Value) -> Result<&Vec<Value>> {
    list["plugins"].as_array().context("no plugins array")
}

fn ours_count(list: &Value) -> Result<usize> {
    Ok(plugins(list)?
        .iter()
        .filter(|p| p["type"] == PLUGIN_TYPE)
        .count())
}

/// `list` holds our entry exactly once, last, and otherwise equals `original_list` as JSON.
fn check_chained(list: &Value, original_list: &Value, run_dir: &str) -> Result<()> {
    let p = plugins(list)?;
    ensure!(ours_count(list)? == 1, "entry count in {list}");
    let last = p.last().context("empty plugins")?;
    ensure!(last["type"] == PLUGIN_TYPE && last["name"] == PLUGIN_TYPE);
    ensure!(last["cni_agent_run_dir"] == run_dir);
    ensure!(last["exclude_namespaces"] == json!(["kube-system"]));
    ensure!(
        last.get("cniVersion").is_none(),
        "our entry has a cniVersion"
    );
    let mut stripped = list.clone();
    stripped["plugins"].as_array_mut().context("plugins")?.pop();
    ensure!(
        stripped == *original_list,
        "rest changed:\n{stripped}\nvs\n{original_list}"
    );
    Ok(())
}

fn real_files() -> Result<Vec<String>> {
    let mut names: Vec<String> = fs::read_dir(REAL)
        .with_context(|| format!("read {REAL}"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .filter(|n: &Result<String>| n.as_ref().map_or(true, |n| n != "SOURCES.md"))
        .collect::<Result<_>>()?;
    names.sort();
    ensure!(
        names.len() >= 14,
        "expected the 14 real configs, found {names:?}"
    );
    Ok(names)
}

#[test]
fn chains_into_every_real_config_and_gives_it_back() -> Result<()> {
    for name in real_files()? {
        let node = Node::new()?;
        let original_bytes = node.copy_in(&Path::new(REAL).join(&name), &name)?;
        let original: Value = serde_json::from_slice(&original_bytes)?;
        let outcome = install::install(&node.cfg).with_context(|| name.clone())?;
        ensure!(
            outcome.conf.changed && outcome.binary_written,
            "{name}: {outcome:?}"
        );

        let is_conf = name.ends_with(".conf");
        let list_name = if is_conf {
            format!("{name}list")
        } else {
            name.clone()
        };
        ensure!(
            node.names()? == [list_name.clone()],
            "{name}: files {:?}",
            node.names()?
        );
        ensure!(outcome.conf.primary == node.conf(&list_name));
        let list = node.json(&list_name)?;
        let original_list = if is_conf {
            let mut plugin = original.clone();
            let obj = plugin.as_object_mut().context("conf object")?;
            obj.shift_remove("cniVersion");
            json!({"cniVersion": original["cniVersion"], "name": original["name"], "plugins": [plugin]})
        } else {
            original.clone()
        };
        let mut without_marker = list.clone();
        if is_conf {
            let last = without_marker["plugins"]
                .as_array_mut()
                .and_then(|p| p.last_mut())
                .and_then(Value::as_object_mut)
                .context("last plugin")?;
            ensure!(last.shift_remove(CONVERTED_FROM_KEY) == Some(json!(name)));
        }
        check_chained(&without_marker, &original_list, "/var/run/ztnode").context(name.clone())?;
        ensure!(
            list["cniVersion"] == original["cniVersion"],
            "{name}: version changed"
        );

        let first = fs::read(node.conf(&list_name))?;
        ensure!(
            first.ends_with(b"}\n") && first.starts_with(b"{\n  \""),
            "{name}: format"
        );
        for _ in 0..5 {
            let again = install::install(&node.cfg)?;
            ensure!(!again.changed(), "{name}: re-install changed something");
            ensure!(
                fs::read(node.conf(&list_name))? == first,
                "{name}: bytes changed"
            );
        }
        ensure!(install::is_installed(&node.cfg)?);

        install::uninstall(&node.cfg)?;
        ensure!(
            node.names()? == [name.clone()],
            "{name}: after uninstall {:?}",
            node.names()?
        );
        ensure!(node.json(&name)? == original, "{name}: not restored");
        ensure!(!node.cfg.installed_binary().exists());
        install::uninstall(&node.cfg).context("second uninstall")?;
        ensure!(node.json(&name)? == original);
    }
    Ok(())
}

#[test]
fn bridge_conf_becomes_list_like_istio_golden() -> Result<()> {
    let node = Node::new()?;
    let original_bytes = node.copy_in(&Path::new(ISTIO).join("bridge.conf"), "bridge.conf")?;
    let original: Value = serde_json::from_slice(&original_bytes)?;
    let golden: Value =
        serde_json::from_slice(&fs::read(Path::new(ISTIO).join("bridge.conf.golden"))?)?;
    let outcome = install::install(&node.cfg)?;
    ensure!(outcome.conf.converted_from == Some(node.conf("bridge.conf")));
    ensure!(node.names()? == ["bridge.conflist"]);
    let list = node.json("bridge.conflist")?;
    // Same shape as Istio's: the old conf minus cniVersion (name kept), then our entry.
    ensure!(plugins(&list)?.len() == plugins(&golden)?.len());
    ensure!(
        list["plugins"][0] == golden["plugins"][0],
        "first plugin: {}",
        list["plugins"][0]
    );
    ensure!(list["plugins"][1]["type"] == PLUGIN_TYPE);
    ensure!(list["plugins"][1][CONVERTED_FROM_KEY] == "bridge.conf");
    // Deliberate difference: we keep the conf's version and network name.
    ensure!(list["cniVersion"] == "0.4.0" && list["name"] == "dbnet");
    let keys: Vec<&String> = list.as_object().context("object")?.keys().collect();
    ensure!(keys == ["cniVersion", "name", "plugins"]);

    install::uninstall(&node.cfg)?;
    ensure!(node.names()? == ["bridge.conf"]);
    ensure!(node.json("bridge.conf")? == original);
    Ok(())
}

/// Structure of an Istio golden: top-level keys, and every plugin but the last, equal as JSON; the
/// last plugin is the mesh entry (istio-cni there, ztnode-cni here).
fn same_structure(ours: &Value, golden: &Value) -> Result<()> {
    let (o, g) = (plugins(ours)?, plugins(golden)?);
    ensure!(
        o.len() == g.len(),
        "plugin count {} vs {}",
        o.len(),
        g.len()
    );
    ensure!(o[..o.len() - 1] == g[..g.len() - 1], "plugins differ");
    ensure!(o[o.len() - 1]["type"] == PLUGIN_TYPE && g[g.len() - 1]["type"] == "istio-cni");
    for (k, v) in golden.as_object().context("golden object")? {
        ensure!(k == "plugins" || ours[k] == *v, "top-level {k} differs");
    }
    ensure!(ours.as_object().map(|m| m.len()) == golden.as_object().map(|m| m.len()));
    Ok(())
}

#[test]
fn insertion_matches_istio_list_goldens() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(&Path::new(ISTIO).join("list.conflist"), "list.conflist")?;
    install::install(&node.cfg)?;
    let golden: Value =
        serde_json::from_slice(&fs::read(Path::new(ISTIO).join("list.conflist.golden"))?)?;
    same_structure(&node.json("list.conflist")?, &golden)?;

    // list-with-istio.conflist holds a legacy entry of the mesh plugin: with our type in its place,
    // the legacy entry (and its stale keys such as "kubernetes") is replaced, as Istio does.
    let node = Node::new()?;
    let text = fs::read_to_string(Path::new(ISTIO).join("list-with-istio.conflist"))?;
    node.put(
        "list.conflist",
        text.replace("\"istio-cni\"", "\"ztnode-cni\"").as_bytes(),
    )?;
    install::install(&node.cfg)?;
    let golden: Value = serde_json::from_slice(&fs::read(
        Path::new(ISTIO).join("list-with-istio.conflist.golden"),
    )?)?;
    let list = node.json("list.conflist")?;
    same_structure(&list, &golden)?;
    ensure!(list["plugins"][2].get("kubernetes").is_none());
    ensure!(list["plugins"][2].get("plugin_log_level").is_none());
    Ok(())
}

#[test]
fn duplicate_entries_collapse_to_one() -> Result<()> {
    let node = Node::new()?;
    let ours = json!({"type": PLUGIN_TYPE, "name": PLUGIN_TYPE, "cni_agent_run_dir": "/old"});
    let list = json!({"cniVersion": "0.4.0", "name": "n",
        "plugins": [ours.clone(), {"type": "ptp"}, ours, {"type": "portmap"}]});
    node.put("10-n.conflist", list.to_string().as_bytes())?;
    install::install(&node.cfg)?;
    let after = node.json("10-n.conflist")?;
    ensure!(ours_count(&after)? == 1);
    let types: Vec<&Value> = plugins(&after)?.iter().map(|p| &p["type"]).collect();
    ensure!(types == [&json!("ptp"), &json!("portmap"), &json!(PLUGIN_TYPE)]);
    ensure!(after["plugins"][2]["cni_agent_run_dir"] == "/var/run/ztnode");
    install::uninstall(&node.cfg)?;
    ensure!(ours_count(&node.json("10-n.conflist")?)? == 0);
    Ok(())
}

#[test]
fn versions_and_vendor_keys_survive() -> Result<()> {
    for version in ["0.3.0", "1.1.0"] {
        let node = Node::new()?;
        let list = json!({
            "cniVersion": version, "name": "v", "x-vendor": {"a": [1, 2]}, "disableGC": true,
            "plugins": [{"type": "ptp", "x-vendor-plugin": {"deep": {"k": "v"}}, "mtu": 1500}]
        });
        let text = serde_json::to_string_pretty(&list)?;
        node.put("10-v.conflist", text.as_bytes())?;
        install::install(&node.cfg)?;
        let after = node.json("10-v.conflist")?;
        check_chained(&after, &list, "/var/run/ztnode")?;
        let keys: Vec<&String> = after.as_object().context("object")?.keys().collect();
        ensure!(keys == ["cniVersion", "name", "x-vendor", "disableGC", "plugins"]);
        let pkeys: Vec<&String> = after["plugins"][0]
            .as_object()
            .context("p")?
            .keys()
            .collect();
        ensure!(pkeys == ["type", "x-vendor-plugin", "mtu"]);
        install::uninstall(&node.cfg)?;
        let restored = fs::read_to_string(node.conf("10-v.conflist"))?;
        ensure!(restored == format!("{text}\n"), "restored text differs");
    }
    Ok(())
}

#[test]
fn lexicographic_priority_and_invalid_files() -> Result<()> {
    let node = Node::new()?;
    let a = json!({"cniVersion": "0.3.1", "name": "a", "plugins": [{"type": "ptp"}]});
    let b = json!({"cniVersion": "0.3.1", "name": "b", "plugins": [{"type": "bridge"}]});
    node.put("05-a.conflist", a.to_string().as_bytes())?;
    node.put("10-b.conflist", b.to_string().as_bytes())?;
    node.copy_in(
        &Path::new(ISTIO).join("invalid-map.conflist"),
        "00-invalid-map.conflist",
    )?;
    node.copy_in(
        &Path::new(ISTIO).join("invalid-arr.conflist"),
        "01-invalid-arr.conflist",
    )?;
    node.put("02-garbage.conflist", b"{ not json")?;
    node.put("03-notype.conf", a.to_string().as_bytes())?;
    node.put("04-empty.conflist", br#"{"name": "e", "plugins": []}"#)?;
    node.put("00-ignored.json", br#"{"type": "bridge"}"#)?;
    let untouched: Vec<(String, Vec<u8>)> = node
        .names()?
        .into_iter()
        .filter(|n| n != "05-a.conflist")
        .map(|n| Ok((n.clone(), fs::read(node.conf(&n))?)))
        .collect::<Result<_>>()?;

    let outcome = install::install(&node.cfg)?;
    ensure!(outcome.conf.primary == node.conf("05-a.conflist"));
    check_chained(&node.json("05-a.conflist")?, &a, "/var/run/ztnode")?;
    for (name, bytes) in &untouched {
        ensure!(fs::read(node.conf(name))? == *bytes, "{name} was modified");
    }
    Ok(())
}

#[test]
fn multus_wins_over_flannel() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(&Path::new(REAL).join("00-multus.conf"), "00-multus.conf")?;
    let flannel = node.copy_in(
        &Path::new(REAL).join("10-flannel.conflist"),
        "10-flannel.conflist",
    )?;
    let outcome = install::install(&node.cfg)?;
    ensure!(outcome.conf.primary == node.conf("00-multus.conflist"));
    ensure!(node.names()? == ["00-multus.conflist", "10-flannel.conflist"]);
    ensure!(fs::read(node.conf("10-flannel.conflist"))? == flannel);
    Ok(())
}

/// Multus's generated config, as Multus writes it from the cluster network's list `delegate`.
fn multus_conf(delegate: &Value) -> Result<Vec<u8>> {
    let mut conf: Value =
        serde_json::from_slice(&fs::read(Path::new(REAL).join("00-multus.conf"))?)?;
    conf["delegates"] = json!([delegate]);
    Ok(serde_json::to_vec_pretty(&conf)?)
}

/// How many times the runtime would run our plugin for a pod with `list` as the config: its own
/// entries plus those inside any plugin's `delegates` (Multus runs each delegate's chain).
fn runs_per_pod(list: &Value) -> Result<usize> {
    let mut n = ours_count(list)?;
    for p in plugins(list)? {
        for d in p["delegates"].as_array().into_iter().flatten() {
            n += usize::from(d["type"] == PLUGIN_TYPE);
            n += d["plugins"].as_array().map_or(0, |ps| {
                ps.iter().filter(|p| p["type"] == PLUGIN_TYPE).count()
            });
        }
    }
    Ok(n)
}

#[test]
fn behind_multus_the_plugin_runs_once_per_pod() -> Result<()> {
    // ztnode chained into flannel first; then Multus came up and embedded the chained flannel list.
    let node = Node::new()?;
    let flannel = node.copy_in(
        &Path::new(REAL).join("10-flannel.conflist"),
        "10-flannel.conflist",
    )?;
    install::install(&node.cfg)?;
    let chained = node.json("10-flannel.conflist")?;
    ensure!(ours_count(&chained)? == 1);
    node.put("00-multus.conf", &multus_conf(&chained)?)?;
    let report = install::inspect_conf_dir(&node.cfg.cni_conf_dir)?;
    ensure!(report.ours() == 1 && report.embedded == 1, "{report:?}");
    ensure!(!install::is_installed(&node.cfg)?);

    let outcome = install::install(&node.cfg)?;
    ensure!(outcome.conf.primary == node.conf("00-multus.conflist"));
    let primary = node.json("00-multus.conflist")?;
    ensure!(runs_per_pod(&primary)? == 1, "runs twice: {primary:#}");
    ensure!(plugins(&primary)?.last().context("plugins")?["type"] == PLUGIN_TYPE);
    let original: Value = serde_json::from_slice(&flannel)?;
    ensure!(
        primary["plugins"][0]["delegates"][0] == original,
        "Multus's delegate is not the cluster network as it was: {primary:#}"
    );
    ensure!(node.json("10-flannel.conflist")? == original);
    ensure!(install::is_installed(&node.cfg)?);
    let report = install::inspect_conf_dir(&node.cfg.cni_conf_dir)?;
    ensure!(
        report.ours() == 1 && report.embedded == 0 && report.stray.is_empty(),
        "{report:?}"
    );

    // Multus rewrites its config from the (now clean) flannel list: one entry again.
    node.put("00-multus.conf", &multus_conf(&original)?)?;
    install::install(&node.cfg)?;
    ensure!(node.names()? == ["00-multus.conflist", "10-flannel.conflist"]);
    ensure!(runs_per_pod(&node.json("00-multus.conflist")?)? == 1);

    install::uninstall(&node.cfg)?;
    ensure!(node.names()? == ["00-multus.conf", "10-flannel.conflist"]);
    ensure!(
        node.json("00-multus.conf")? == serde_json::from_slice::<Value>(&multus_conf(&original)?)?
    );
    Ok(())
}

#[test]
fn uninstall_removes_our_entry_from_multus_delegates() -> Result<()> {
    // A leftover: Multus's own .conf (not converted by us) embeds a chained list.
    let node = Node::new()?;
    let flannel: Value =
        serde_json::from_slice(&fs::read(Path::new(REAL).join("10-flannel.conflist"))?)?;
    let mut chained = flannel.clone();
    chained["plugins"]
        .as_array_mut()
        .context("plugins")?
        .push(json!({"type": PLUGIN_TYPE, "name": PLUGIN_TYPE}));
    node.put("00-multus.conf", &multus_conf(&chained)?)?;
    install::uninstall(&node.cfg)?;
    let conf = node.json("00-multus.conf")?;
    ensure!(conf["delegates"] == json!([flannel]), "{conf:#}");
    Ok(())
}

#[test]
fn entry_follows_a_new_higher_priority_config() -> Result<()> {
    let node = Node::new()?;
    let b = node.copy_in(
        &Path::new(REAL).join("10-flannel.conflist"),
        "10-flannel.conflist",
    )?;
    install::install(&node.cfg)?;
    node.copy_in(
        &Path::new(REAL).join("05-cilium.conflist"),
        "05-cilium.conflist",
    )?;
    ensure!(!install::is_installed(&node.cfg)?);
    let outcome = install::install(&node.cfg)?;
    ensure!(outcome.conf.primary == node.conf("05-cilium.conflist"));
    ensure!(ours_count(&node.json("05-cilium.conflist")?)? == 1);
    let original: Value = serde_json::from_slice(&b)?;
    ensure!(
        node.json("10-flannel.conflist")? == original,
        "stale entry left in flannel"
    );
    Ok(())
}

#[test]
fn conf_mode_is_kept() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(
        &Path::new(REAL).join("100-crio-bridge.conf"),
        "100-crio-bridge.conf",
    )?;
    fs::set_permissions(
        node.conf("100-crio-bridge.conf"),
        fs::Permissions::from_mode(0o600),
    )?;
    install::install(&node.cfg)?;
    let mode = fs::metadata(node.conf("100-crio-bridge.conflist"))?.mode() & 0o7777;
    ensure!(mode == 0o600, "mode {mode:o}");
    install::uninstall(&node.cfg)?;
    let mode = fs::metadata(node.conf("100-crio-bridge.conf"))?.mode() & 0o7777;
    ensure!(mode == 0o600, "mode {mode:o}");
    Ok(())
}

#[test]
fn no_primary_config_is_reported_and_binary_still_copied() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(
        &Path::new(ISTIO).join("invalid-map.conflist"),
        "10-x.conflist",
    )?;
    let err = install::install(&node.cfg)
        .err()
        .context("install succeeded")?;
    ensure!(matches!(err, InstallError::NoPrimaryConfig { .. }), "{err}");
    ensure!(
        err.to_string()
            .contains(&node.cfg.cni_conf_dir.display().to_string())
    );
    ensure!(node.cfg.installed_binary().exists());
    ensure!(!install::is_installed(&node.cfg)?);
    Ok(())
}

#[test]
fn binary_copy_is_atomic_and_skipped_when_identical() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(
        &Path::new(REAL).join("10-kindnet.conflist"),
        "10-kindnet.conflist",
    )?;
    let stale = node
        .cfg
        .cni_bin_dir
        .join(format!("{PLUGIN_BINARY_NAME}.tmp.deadbeef"));
    fs::write(&stale, b"half a binary")?;
    fs::write(node.cfg.cni_bin_dir.join("portmap"), b"other plugin")?;
    install::install(&node.cfg)?;
    let target = node.cfg.installed_binary();
    ensure!(fs::read(&target)? == fs::read(&node.cfg.source_binary)?);
    let md = fs::metadata(&target)?;
    ensure!(md.mode() & 0o7777 == 0o755, "mode {:o}", md.mode() & 0o7777);
    let mut names: Vec<String> = fs::read_dir(&node.cfg.cni_bin_dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    ensure!(
        names == ["portmap", PLUGIN_BINARY_NAME],
        "bin dir: {names:?}"
    );

    std::thread::sleep(Duration::from_millis(20));
    let outcome = install::install(&node.cfg)?;
    ensure!(!outcome.binary_written);
    let again = fs::metadata(&target)?;
    ensure!(
        again.ino() == md.ino()
            && again.mtime_nsec() == md.mtime_nsec()
            && again.mtime() == md.mtime()
    );

    fs::write(&node.cfg.source_binary, b"new version")?;
    ensure!(!install::is_installed(&node.cfg)?);
    ensure!(install::install(&node.cfg)?.binary_written);
    ensure!(fs::read(&target)? == b"new version");
    ensure!(
        fs::metadata(&target)?.ino() != md.ino(),
        "not replaced by rename"
    );
    ensure!(fs::read(node.cfg.cni_bin_dir.join("portmap"))? == b"other plugin");
    install::uninstall(&node.cfg)?;
    ensure!(!target.exists() && node.cfg.cni_bin_dir.join("portmap").exists());
    Ok(())
}

#[test]
fn foreign_sibling_conflist_is_not_overwritten() -> Result<()> {
    let node = Node::new()?;
    node.copy_in(&Path::new(REAL).join("100-crio-bridge.conf"), "10-x.conf")?;
    let list = node.copy_in(
        &Path::new(REAL).join("10-flannel.conflist"),
        "10-x.conflist",
    )?;
    let err = install::install(&node.cfg)
        .err()
        .context("install succeeded")?;
    ensure!(matches!(err, InstallError::ConflistExists { .. }), "{err}");
    ensure!(fs::read(node.conf("10-x.conflist"))? == list);
    Ok(())
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        if cond()? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("timed out waiting for {what}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_repairs_reverted_config_and_stops_on_shutdown() -> Result<()> {
    let node = Node::new()?;
    let original = node.copy_in(
        &Path::new(REAL).join("10-calico.conflist"),
        "10-calico.conflist",
    )?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(install::watch_and_repair(node.cfg.clone(), async move {
        let _ = stopped.await;
    }));
    let cfg = node.cfg.clone();
    wait_until("initial install", || Ok(install::is_installed(&cfg)?)).await?;

    // The primary CNI rewrites its config (atomically, as most do): our entry is gone.
    let tmp = node.conf(".calico.tmp");
    fs::write(&tmp, &original)?;
    fs::rename(&tmp, node.conf("10-calico.conflist"))?;
    wait_until("repair after rewrite", || {
        Ok(ours_count(&node.json("10-calico.conflist")?)? == 1)
    })
    .await?;

    // In-place rewrite without rename.
    fs::write(node.conf("10-calico.conflist"), &original)?;
    wait_until("repair after in-place write", || {
        Ok(ours_count(&node.json("10-calico.conflist")?)? == 1)
    })
    .await?;

    fs::remove_file(node.cfg.installed_binary())?;
    wait_until("binary re-copied", || {
        Ok(node.cfg.installed_binary().exists())
    })
    .await?;
    wait_until("fully installed", || Ok(install::is_installed(&cfg)?)).await?;

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .context("watch_and_repair did not stop")???;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_waits_for_a_primary_config() -> Result<()> {
    let node = Node::new()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(install::watch_and_repair(node.cfg.clone(), async move {
        let _ = stopped.await;
    }));
    wait_until("binary copied", || Ok(node.cfg.installed_binary().exists())).await?;
    ensure!(!task.is_finished(), "loop ended without a primary config");
    node.copy_in(
        &Path::new(REAL).join("10-gke-ptp.conflist"),
        "10-gke-ptp.conflist",
    )?;
    let cfg = node.cfg.clone();
    wait_until("install once the primary appears", || {
        Ok(install::is_installed(&cfg)?)
    })
    .await?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .context("watch_and_repair did not stop")???;
    Ok(())
}

/// A service-account dir laid out as the kubelet projects it: `token` and `ca.crt` are symlinks
/// through `..data`, which is swapped atomically on rotation.
fn project_service_account(dir: &Path, generation: u32, token: &str) -> Result<()> {
    let data = dir.join(format!("..gen{generation}"));
    fs::create_dir_all(&data)?;
    fs::write(data.join("token"), token)?;
    fs::write(
        data.join("ca.crt"),
        "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
    )?;
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(data.file_name().context("name")?, &tmp)?;
    fs::rename(&tmp, dir.join("..data"))?;
    for name in ["token", "ca.crt"] {
        if fs::symlink_metadata(dir.join(name)).is_err() {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name))?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_rewrites_the_plugin_kubeconfig_on_token_rotation() -> Result<()> {
    let mut node = Node::new()?;
    node.copy_in(
        &Path::new(REAL).join("10-calico.conflist"),
        "10-calico.conflist",
    )?;
    let sa = tempfile::tempdir()?;
    project_service_account(sa.path(), 1, "token-one")?;
    let run = tempfile::tempdir()?;
    node.cfg.run_dir = run.path().to_owned();
    node.cfg.kube = Some(install::PluginKube {
        source: install::KubeconfigSource::InCluster(install::InClusterApi {
            host: "fd00:10:96::1".into(),
            port: "443".into(),
            service_account_dir: sa.path().to_owned(),
        }),
        enablement_selector: None,
        namespace: "ztnode-system".into(),
    });
    let kubeconfig = install::kubeconfig_path(run.path());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(install::watch_and_repair(node.cfg.clone(), async move {
        let _ = stopped.await;
    }));
    let cfg = node.cfg.clone();
    wait_until("initial install", || Ok(install::is_installed(&cfg)?)).await?;
    let text = fs::read_to_string(&kubeconfig)?;
    ensure!(text.contains("token: token-one\n"), "{text}");
    ensure!(
        text.contains("server: https://[fd00:10:96::1]:443\n"),
        "{text}"
    );
    ensure!(fs::metadata(&kubeconfig)?.mode() & 0o7777 == 0o600);
    let list = node.json("10-calico.conflist")?;
    let entry = plugins(&list)?.last().context("entry")?;
    ensure!(
        entry["kubeconfig"] == json!(kubeconfig.display().to_string()),
        "{entry}"
    );
    ensure!(entry["ztnode_namespace"] == "ztnode-system", "{entry}");
    ensure!(
        entry.get("ambient_enablement_selector").is_none(),
        "{entry}"
    );

    // The kubelet rotates the token: the loop notices the SA dir change and rewrites.
    project_service_account(sa.path(), 2, "token-two")?;
    wait_until("kubeconfig with the rotated token", || {
        Ok(fs::read_to_string(&kubeconfig)?.contains("token: token-two\n"))
    })
    .await?;
    let conf_before = fs::read(node.conf("10-calico.conflist"))?;

    // Removed by someone: written again (at the latest on the periodic resync; the binary's
    // re-copy below triggers a pass sooner).
    fs::remove_file(&kubeconfig)?;
    fs::remove_file(node.cfg.installed_binary())?;
    wait_until("kubeconfig written again", || Ok(kubeconfig.exists())).await?;
    wait_until("fully installed", || Ok(install::is_installed(&cfg)?)).await?;
    ensure!(
        fs::read(node.conf("10-calico.conflist"))? == conf_before,
        "token rotation does not touch the CNI config"
    );

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .context("watch_and_repair did not stop")???;
    install::uninstall(&node.cfg)?;
    ensure!(!kubeconfig.exists(), "uninstall removes the kubeconfig");
    ensure!(ours_count(&node.json("10-calico.conflist")?)? == 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_chains_the_entry_only_once_the_kubeconfig_exists() -> Result<()> {
    let mut node = Node::new()?;
    node.copy_in(
        &Path::new(REAL).join("10-calico.conflist"),
        "10-calico.conflist",
    )?;
    let sa = tempfile::tempdir()?;
    let run = tempfile::tempdir()?;
    node.cfg.run_dir = run.path().to_owned();
    node.cfg.kube = Some(install::PluginKube {
        source: install::KubeconfigSource::InCluster(install::InClusterApi {
            host: "10.96.0.1".into(),
            port: "443".into(),
            service_account_dir: sa.path().to_owned(),
        }),
        enablement_selector: Some(String::new()),
        namespace: "mesh".into(),
    });
    ensure!(
        matches!(
            install::install(&node.cfg),
            Err(InstallError::ReadFile { .. })
        ),
        "no service account yet: install fails before touching the CNI config"
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(install::watch_and_repair(node.cfg.clone(), async move {
        let _ = stopped.await;
    }));
    wait_until("binary copied", || Ok(node.cfg.installed_binary().exists())).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        ours_count(&node.json("10-calico.conflist")?)? == 0,
        "entry before kubeconfig"
    );

    project_service_account(sa.path(), 1, "t")?;
    let cfg = node.cfg.clone();
    wait_until("installed once the token appears", || {
        Ok(install::is_installed(&cfg)?)
    })
    .await?;
    let list = node.json("10-calico.conflist")?;
    let entry = plugins(&list)?.last().context("entry")?;
    ensure!(entry["ambient_enablement_selector"] == "", "{entry}");
    ensure!(entry["ztnode_namespace"] == "mesh", "{entry}");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .context("watch_and_repair did not stop")???;
    Ok(())
}
