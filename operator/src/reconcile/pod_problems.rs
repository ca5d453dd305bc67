//! Pods that cannot start: a missing Secret or ConfigMap, an image that cannot be pulled, a
//! container that crashes or is OOM-killed, a pod nobody can schedule. Status names them with
//! the pod's own reason and message rather than claiming a step that never happened. Pure.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

/// Waiting reasons of a container that will not run without a change somewhere.
const STUCK_WAITING: &[&str] = &[
    "CreateContainerConfigError",
    "CreateContainerError",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RunContainerError",
    "CrashLoopBackOff",
];

/// Why `pod` cannot start or keep running: (reason, message), the pod's own words.
pub fn cannot_start(pod: &Pod) -> Option<(String, String)> {
    let status = pod.status.as_ref()?;
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    if status.phase.as_deref() == Some("Failed") {
        return Some((status.reason.clone().unwrap_or_else(|| "Failed".into()), status.message.clone().unwrap_or_default()));
    }
    let unschedulable =
        status.conditions.iter().flatten().find(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"));
    if let Some(c) = unschedulable {
        return Some(("Unschedulable".into(), c.message.clone().unwrap_or_default()));
    }
    let containers = status.init_container_statuses.iter().flatten().chain(status.container_statuses.iter().flatten());
    containers.filter_map(container).next()
}

fn container(c: &ContainerStatus) -> Option<(String, String)> {
    let state = c.state.as_ref()?;
    let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
    if let Some(w) = state.waiting.as_ref().filter(|w| w.reason.as_deref().is_some_and(|r| STUCK_WAITING.contains(&r))) {
        let reason = w.reason.clone().unwrap_or_default();
        let mut message = w.message.clone().unwrap_or_default();
        // A crash loop's own message says little: the last termination says why.
        if let Some(t) = last.filter(|_| reason == "CrashLoopBackOff") {
            message = format!("{message} (last exit: {} with code {})", t.reason.as_deref().unwrap_or("Error"), t.exit_code);
        }
        return Some((reason, format!("container {}: {}", c.name, message.trim())));
    }
    let oom = last.filter(|t| t.reason.as_deref() == Some("OOMKilled")).or(state.terminated.as_ref().filter(|t| t.reason.as_deref() == Some("OOMKilled")));
    oom.map(|t| ("OOMKilled".to_string(), format!("container {} was killed for exceeding its memory limit (exit code {})", c.name, t.exit_code)))
}

/// A pod that cannot start, as status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckPod {
    pub pod: String,
    /// The worker revision it belongs to; `None` for the router.
    pub revision: Option<String>,
    pub reason: String,
    pub message: String,
}

impl StuckPod {
    pub fn describe(&self) -> String {
        format!("pod {} cannot start: {}: {}", self.pod, self.reason, self.message)
    }

    /// The Secret the kubelet could not find for it (`secret "NAME" not found`, or the API's
    /// own `secrets "NAME" not found` quoted in a longer message), if that is why.
    pub fn missing_secret(&self) -> Option<&str> {
        if self.reason != "CreateContainerConfigError" {
            return None;
        }
        self.message.match_indices("\" not found").find_map(|(end, _)| {
            let before = &self.message[..end];
            let open = before.rfind('"')?;
            let kind = before[..open].trim_end_matches(' ');
            (kind.ends_with("secret") || kind.ends_with("secrets")).then(|| &before[open + 1..])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({ "metadata": { "name": "p" }, "status": status })).unwrap()
    }

    #[test]
    fn each_way_a_pod_cannot_start_is_named_in_its_own_words() {
        let rows = [
            (
                serde_json::json!({ "phase": "Pending", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                    "state": { "waiting": { "reason": "CreateContainerConfigError", "message": "secret \"llm-handoff-1\" not found" } } }] }),
                Some(("CreateContainerConfigError", "container worker: secret \"llm-handoff-1\" not found")),
            ),
            (
                serde_json::json!({ "phase": "Pending", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                    "state": { "waiting": { "reason": "ImagePullBackOff", "message": "Back-off pulling image \"nope\"" } } }] }),
                Some(("ImagePullBackOff", "container worker: Back-off pulling image \"nope\"")),
            ),
            (
                serde_json::json!({ "phase": "Running", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 3,
                    "state": { "waiting": { "reason": "CrashLoopBackOff", "message": "back-off 40s" } },
                    "lastState": { "terminated": { "reason": "OOMKilled", "exitCode": 137 } } }] }),
                Some(("CrashLoopBackOff", "container worker: back-off 40s (last exit: OOMKilled with code 137)")),
            ),
            (
                serde_json::json!({ "phase": "Running", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
                    "state": { "running": {} }, "lastState": { "terminated": { "reason": "OOMKilled", "exitCode": 137 } } }] }),
                Some(("OOMKilled", "container worker was killed for exceeding its memory limit (exit code 137)")),
            ),
            (
                serde_json::json!({ "phase": "Pending", "conditions": [{ "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes are available" }] }),
                Some(("Unschedulable", "0/2 nodes are available")),
            ),
            (
                serde_json::json!({ "phase": "Pending", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                    "state": { "waiting": { "reason": "ContainerCreating" } } }] }),
                None,
            ),
            (
                serde_json::json!({ "phase": "Running", "containerStatuses": [{ "name": "worker", "image": "i", "imageID": "", "ready": true, "restartCount": 0, "state": { "running": {} } }] }),
                None,
            ),
        ];
        for (status, want) in rows {
            let got = cannot_start(&pod(status.clone()));
            assert_eq!(got.as_ref().map(|(r, m)| (r.as_str(), m.as_str())), want, "{status}");
        }
    }

    #[test]
    fn a_missing_secret_is_named_only_when_the_kubelet_says_so() {
        let stuck = |reason: &str, message: &str| StuckPod { pod: "p".into(), revision: None, reason: reason.into(), message: message.into() };
        assert_eq!(stuck("CreateContainerConfigError", "container worker: secret \"llm-handoff-1\" not found").missing_secret(), Some("llm-handoff-1"));
        let mount = "container worker: volume handoff-secret: secret llm-handoff-1: ApiError: secrets \"llm-handoff-1\" not found: NotFound (Status { message: \"secrets \\\"llm-handoff-1\\\" not found\" })";
        assert_eq!(stuck("CreateContainerConfigError", mount).missing_secret(), Some("llm-handoff-1"));
        assert_eq!(stuck("CreateContainerConfigError", "container worker: configmap \"x\" not found").missing_secret(), None);
        assert_eq!(stuck("ImagePullBackOff", "secret \"llm-handoff-1\" not found").missing_secret(), None);
    }
}
