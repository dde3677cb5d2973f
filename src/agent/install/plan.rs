//! Deciding what to write: given a snapshot of the CNI config dir, the file edits that put our entry
//! into the primary config (install) or take it out everywhere (uninstall). Pure; the caller applies
//! the actions in order.

use std::path::Path;

use serde_json::Value;

use super::InstallError;
use super::conflist::{self, ConfKind, EntryParams};

/// One `.conf`/`.conflist` file of the config dir as read.
#[derive(Debug, Clone)]
pub(crate) struct ConfFile {
    /// File name inside the config dir.
    pub name: String,
    /// Parsed content; `None` if it is not JSON.
    pub value: Option<Value>,
    /// Permission bits (`st_mode & 0o7777`), kept when we rewrite or convert the file.
    pub mode: u32,
}

/// A file operation in the config dir.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Atomically (re)write `name` with `value` rendered, with permission bits `mode`.
    Write {
        name: String,
        value: Value,
        mode: u32,
    },
    /// Remove `name`.
    Remove { name: String },
}

/// What installing means for the current snapshot.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct InstallPlan {
    /// The file that holds our entry once the actions ran.
    pub primary: String,
    /// `X.conf` when the primary is a `.conf` converted to `X.conflist` (now or earlier).
    pub converted_from: Option<String>,
    /// Edits, in order; empty when everything is in place.
    pub actions: Vec<Action>,
}

/// The primary config: the first file (sorted by name) that the runtime accepts.
pub(crate) fn primary(files: &[ConfFile]) -> Option<(&ConfFile, ConfKind)> {
    files.iter().find_map(|f| {
        let kind = conflist::classify(&f.name, f.value.as_ref()?)?;
        Some((f, kind))
    })
}

/// Plans an install: our entry last (exactly once) in the primary, a single-plugin `.conf` primary
/// converted to a `.conflist`, and stale entries of ours removed from every other file.
///
/// `files` must be sorted by name. Errors: [`InstallError::NoPrimaryConfig`] when no file is valid,
/// [`InstallError::ConflistExists`] when converting `X.conf` would overwrite a foreign `X.conflist`.
pub(crate) fn plan_install(
    dir: &Path,
    files: &[ConfFile],
    params: &EntryParams,
) -> Result<InstallPlan, InstallError> {
    let Some((first, kind)) = primary(files) else {
        return Err(InstallError::NoPrimaryConfig {
            dir: dir.to_owned(),
        });
    };
    let mut actions = Vec::new();
    let (primary_name, converted_from) = match (kind, &first.value) {
        (ConfKind::List, Some(list)) => {
            let from = conflist::converted_from(&first.name, list);
            let entry = conflist::our_entry(params, from.as_deref());
            if let Some(desired) = conflist::with_entry(list, entry)
                && desired != *list
            {
                actions.push(Action::Write {
                    name: first.name.clone(),
                    value: desired,
                    mode: first.mode,
                });
            }
            (first.name.clone(), from)
        }
        (ConfKind::Single, Some(conf)) if !conflist::is_ours(conf) => {
            let list_name = convert_target(dir, files, &first.name)?;
            let entry = conflist::our_entry(params, Some(&first.name));
            if let Some(value) = conflist::conf_to_list(conf, entry) {
                actions.push(Action::Write {
                    name: list_name.clone(),
                    value,
                    mode: first.mode,
                });
                actions.push(Action::Remove {
                    name: first.name.clone(),
                });
            }
            (list_name, Some(first.name.clone()))
        }
        // A standalone `.conf` of our own type: nothing to chain into.
        _ => (first.name.clone(), None),
    };
    for f in files
        .iter()
        .filter(|f| f.name != primary_name && f.name != first.name)
    {
        actions.extend(strip(f, files));
    }
    Ok(InstallPlan {
        primary: primary_name,
        converted_from,
        actions,
    })
}

/// Plans an uninstall: our entries removed from every file, converted `.conf` files given back.
pub(crate) fn plan_uninstall(files: &[ConfFile]) -> Vec<Action> {
    files.iter().flat_map(|f| strip(f, files)).collect()
}

/// `X.conflist` for the primary `X.conf`, unless a foreign `X.conflist` already exists.
fn convert_target(dir: &Path, files: &[ConfFile], conf_name: &str) -> Result<String, InstallError> {
    let list_name = conflist::conflist_name_for(conf_name).unwrap_or_default();
    let existing = files.iter().find(|f| f.name == list_name);
    let ours = existing.and_then(|f| conflist::converted_from(&f.name, f.value.as_ref()?));
    match existing {
        Some(_) if ours.as_deref() != Some(conf_name) => Err(InstallError::ConflistExists {
            conf: dir.join(conf_name),
            conflist: dir.join(&list_name),
        }),
        _ => Ok(list_name),
    }
}

/// Actions removing our entries from one file (nothing if it has none). A list we converted from
/// `X.conf` becomes `X.conf` again (or is just removed if `X.conf` exists again); a list that would be
/// left without plugins is not touched.
fn strip(file: &ConfFile, files: &[ConfFile]) -> Vec<Action> {
    let Some(value) = &file.value else {
        return Vec::new();
    };
    if conflist::count_ours(value) + conflist::count_embedded(value) == 0 {
        return Vec::new();
    }
    let Some(stripped) = conflist::without_entries(value) else {
        // A `.conf` (Multus's) with our entry only inside its delegates.
        return vec![Action::Write {
            name: file.name.clone(),
            value: conflist::conf_without_embedded(value),
            mode: file.mode,
        }];
    };
    if stripped["plugins"].as_array().is_none_or(Vec::is_empty) {
        tracing::warn!(file = %file.name, "only ztnode entries in this config; leaving it alone");
        return Vec::new();
    }
    let remove = Action::Remove {
        name: file.name.clone(),
    };
    if let Some(conf_name) = conflist::converted_from(&file.name, value)
        && let Some(conf) = conflist::list_to_conf(&stripped)
    {
        if files.iter().any(|f| f.name == conf_name) {
            return vec![remove];
        }
        let write = Action::Write {
            name: conf_name,
            value: conf,
            mode: file.mode,
        };
        return vec![write, remove];
    }
    vec![Action::Write {
        name: file.name.clone(),
        value: stripped,
        mode: file.mode,
    }]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params() -> EntryParams {
        EntryParams {
            run_dir: "/run/z".into(),
            exclude_namespaces: vec![],
            log_level: None,
            kube: None,
        }
    }

    fn file(name: &str, value: Value) -> ConfFile {
        ConfFile {
            name: name.into(),
            value: Some(value),
            mode: 0o644,
        }
    }

    fn apply(files: &[ConfFile], actions: &[Action]) -> Vec<ConfFile> {
        let mut out = files.to_vec();
        for a in actions {
            match a {
                Action::Write { name, value, mode } => {
                    out.retain(|f| &f.name != name);
                    out.push(ConfFile {
                        name: name.clone(),
                        value: Some(value.clone()),
                        mode: *mode,
                    });
                }
                Action::Remove { name } => out.retain(|f| &f.name != name),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    #[test]
    fn skips_invalid_files_for_primary() {
        let files = [
            ConfFile {
                name: "00-bad.conflist".into(),
                value: None,
                mode: 0o644,
            },
            file("01-empty.conflist", json!({})),
            file("02-notype.conf", json!({"plugins": [{"type": "x"}]})),
            file("10-b.conflist", json!({"plugins": [{"type": "ptp"}]})),
        ];
        let plan = plan_install(Path::new("/d"), &files, &params()).unwrap();
        assert_eq!(plan.primary, "10-b.conflist");
        assert_eq!(plan.actions.len(), 1);
    }

    #[test]
    fn no_primary_is_an_error() {
        let err = plan_install(Path::new("/d"), &[file("a.conflist", json!([]))], &params());
        assert!(matches!(err, Err(InstallError::NoPrimaryConfig { .. })));
    }

    #[test]
    fn installed_state_plans_nothing() {
        let files = [file("10-b.conflist", json!({"plugins": [{"type": "ptp"}]}))];
        let plan = plan_install(Path::new("/d"), &files, &params()).unwrap();
        let after = apply(&files, &plan.actions);
        let again = plan_install(Path::new("/d"), &after, &params()).unwrap();
        assert_eq!(again.actions, vec![]);
    }

    #[test]
    fn conf_conversion_and_back() {
        let conf = json!({"cniVersion": "0.3.1", "name": "crio", "type": "bridge"});
        let files = [file("100-crio.conf", conf.clone())];
        let plan = plan_install(Path::new("/d"), &files, &params()).unwrap();
        assert_eq!(plan.primary, "100-crio.conflist");
        assert_eq!(plan.converted_from.as_deref(), Some("100-crio.conf"));
        let after = apply(&files, &plan.actions);
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].name, "100-crio.conflist");
        let again = plan_install(Path::new("/d"), &after, &params()).unwrap();
        assert_eq!(again.actions, vec![]);
        assert_eq!(again.converted_from.as_deref(), Some("100-crio.conf"));
        let restored = apply(&after, &plan_uninstall(&after));
        assert_eq!(restored.len(), 1);
        assert_eq!(restored[0].name, "100-crio.conf");
        assert_eq!(restored[0].value, Some(conf));
    }

    #[test]
    fn foreign_sibling_conflist_blocks_conversion() {
        let files = [
            file("10-a.conf", json!({"type": "bridge"})),
            file("10-a.conflist", json!({"plugins": [{"type": "ptp"}]})),
        ];
        let err = plan_install(Path::new("/d"), &files, &params());
        assert!(matches!(err, Err(InstallError::ConflistExists { .. })));
    }

    #[test]
    fn rewritten_conf_replaces_our_old_conversion() {
        let conf = json!({"name": "a", "type": "bridge"});
        let files = [file("10-a.conf", conf.clone())];
        let plan = plan_install(Path::new("/d"), &files, &params()).unwrap();
        let mut after = apply(&files, &plan.actions);
        after.push(file("10-a.conf", conf));
        after.sort_by(|a, b| a.name.cmp(&b.name));
        let plan = plan_install(Path::new("/d"), &after, &params()).unwrap();
        let after = apply(&after, &plan.actions);
        assert_eq!(after.len(), 1);
        assert_eq!(after[0].name, "10-a.conflist");
    }

    #[test]
    fn entry_moves_when_primary_changes() {
        let b = json!({"plugins": [{"type": "ptp"}]});
        let files = [file("10-b.conflist", b.clone())];
        let plan = plan_install(Path::new("/d"), &files, &params()).unwrap();
        let mut after = apply(&files, &plan.actions);
        after.insert(
            0,
            file("05-a.conflist", json!({"plugins": [{"type": "cilium"}]})),
        );
        let plan = plan_install(Path::new("/d"), &after, &params()).unwrap();
        assert_eq!(plan.primary, "05-a.conflist");
        let after = apply(&after, &plan.actions);
        assert_eq!(after[1].value, Some(b));
        assert_eq!(conflist::count_ours(after[0].value.as_ref().unwrap()), 1);
    }

    #[test]
    fn uninstall_leaves_ours_only_list_alone() {
        let files = [file(
            "a.conflist",
            json!({"plugins": [{"type": conflist::PLUGIN_TYPE}]}),
        )];
        assert_eq!(plan_uninstall(&files), vec![]);
    }
}
