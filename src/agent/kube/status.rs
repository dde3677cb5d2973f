//! The pod status annotation `ambient.istio.io/redirection` (`../shared/spec/istio-cni.md` §3.1):
//! `enabled` after a full enrollment, `pending` while the rules are in but the proxy has not taken
//! the pod, absent otherwise. Written with a merge patch on `pods/status`, as istio-cni does.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};

/// The annotation's key.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// The annotation's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirection {
    /// Rules in place and the proxy serves the pod.
    Enabled,
    /// Rules in place, the proxy has not acked the pod yet.
    Pending,
}

impl Redirection {
    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            Redirection::Enabled => "enabled",
            Redirection::Pending => "pending",
        }
    }

    /// The state a pod's annotations record (`None`: absent or another value).
    pub fn of(pod: &Pod) -> Option<Redirection> {
        match pod
            .metadata
            .annotations
            .as_ref()?
            .get(REDIRECTION_ANNOTATION)?
            .as_str()
        {
            "enabled" => Some(Redirection::Enabled),
            "pending" => Some(Redirection::Pending),
            _ => None,
        }
    }
}

/// Sets (`Some`) or removes (`None`) the annotation on pod `namespace/name`. Removing it from a
/// pod that is gone succeeds.
///
/// # Errors
/// The API server's answer (unreachable, 404 on a set, 403 without `patch pods/status`).
pub async fn write(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    value: Option<Redirection>,
) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let body = serde_json::json!({
        "metadata": {"annotations": {REDIRECTION_ANNOTATION: value.map(Redirection::as_str)}}
    });
    match api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if value.is_none() && s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotation_reads_back_as_written() {
        let mut pod = Pod::default();
        assert_eq!(Redirection::of(&pod), None);
        for v in [Redirection::Enabled, Redirection::Pending] {
            pod.metadata.annotations = Some(
                [(REDIRECTION_ANNOTATION.to_owned(), v.as_str().to_owned())]
                    .into_iter()
                    .collect(),
            );
            assert_eq!(Redirection::of(&pod), Some(v));
        }
        pod.metadata.annotations = Some(
            [(REDIRECTION_ANNOTATION.to_owned(), "other".to_owned())]
                .into_iter()
                .collect(),
        );
        assert_eq!(Redirection::of(&pod), None);
    }
}
