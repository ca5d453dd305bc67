//! Every transition of the rollout, as `decide` sees it: a spec, the status the last pass wrote,
//! and the pods and Deployments found. Each test chains passes the way the operator runs them,
//! feeding each pass's status to the next.

use kvgate_proto::CapacityReport;

use super::*;
use crate::conditions::{self, AVAILABLE, CAPACITY_VERIFIED, PROGRESSING, ROLLOUT_REFUSED};
use crate::reconcile::observe::{NoReport, OwnedDeployment};

const WINDOW: u64 = 2048;

fn deployment(window: u64) -> InferenceDeployment {
    let spec = serde_json::json!({
        "model": { "name": "tiny" }, "contextWindow": window,
        "prefill": { "replicas": 1, "kvPool": { "tokens": 8192 } },
        "decode": { "replicas": 2, "kvPool": { "tokens": 8192 } },
    });
    let mut d = InferenceDeployment::new("llm", serde_json::from_value(spec).unwrap());
    d.metadata.namespace = Some("ns".into());
    d.metadata.generation = Some(1);
    d
}

fn report(tokens: u64, layout: &str) -> CapacityReport {
    CapacityReport {
        capacity_tokens: tokens,
        page_size: 16,
        num_pages: tokens / 16,
        bytes_per_token: 512,
        device: "cpu".into(),
        dtype: "f32".into(),
        model: "tiny".into(),
        model_fingerprint: "m".into(),
        layout_fingerprint: layout.into(),
    }
}

/// The pods and Deployments of one revision: one prefill, two decode, each reporting `tokens`
/// (prefill) and 8192 (decode), all Ready when `ready`.
fn revision(world: &mut World, d: &InferenceDeployment, rev: &str, prefill: Result<CapacityReport, NoReport>, ready: bool) {
    for (role, n, rep) in [(Role::Prefill, 1, prefill), (Role::Decode, 2, Ok(report(8192, "l")))] {
        for i in 0..n {
            let name = format!("{}-{i}", workers::deployment_name(d, role, rev));
            world.pods.push(WorkerPod { name, role, revision: rev.into(), report: rep.clone(), condition: None });
        }
        world.deployments.push(OwnedDeployment { name: workers::deployment_name(d, role, rev), revision: rev.into(), ready: if ready { n } else { 0 } });
    }
    world.router_ready = Some(1);
}

fn pass(d: &mut InferenceDeployment, rev: &str, world: &World) -> Plan {
    let plan = decide(Inputs { d, revision: rev, host_path_refusal: None, world });
    d.status = Some(plan.status.clone());
    plan
}

fn condition(plan: &Plan, type_: &str) -> (bool, String) {
    let c = plan.status.conditions.iter().find(|c| c.type_ == type_).unwrap_or_else(|| panic!("no {type_}"));
    (c.status == "True", c.reason.clone())
}

fn phase(plan: &Plan) -> &str {
    plan.status.phase.as_deref().unwrap()
}

fn sizes(plan: &Plan) -> Vec<(Role, &str, i32)> {
    plan.workers.iter().map(|w| (w.role, w.revision.as_str(), w.replicas)).collect()
}

#[test]
fn first_rollout_waits_for_reports_then_serves_once_verified_and_ready() {
    let mut d = deployment(WINDOW);
    // Nothing exists yet: the candidate's Deployments are created at full size.
    let plan = pass(&mut d, "r1", &World::default());
    assert_eq!(sizes(&plan), [(Role::Prefill, "r1", 1), (Role::Decode, "r1", 2)]);
    assert_eq!((phase(&plan), plan.settled, plan.events.len()), ("Progressing", false, 0));
    assert_eq!(condition(&plan, AVAILABLE), (false, "AwaitingVerification".into()));

    // Pods exist, prefill's report cannot be read yet: its gate condition says why.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Err(NoReport::waiting("GET http://10.0.0.1:8081/v1/kv-pool: connection refused")), false);
    let plan = pass(&mut d, "r1", &world);
    let prefill = &plan.pod_gates[0];
    assert_eq!((prefill.status, prefill.reason.as_str()), ("False", "AwaitingCapacityReport"));
    assert_eq!(prefill.message, "GET http://10.0.0.1:8081/v1/kv-pool: connection refused");
    assert!(plan.pod_gates[1].message.contains("waiting for the prefill pods"), "{:?}", plan.pod_gates[1]);
    assert_eq!(condition(&plan, CAPACITY_VERIFIED), (false, "AwaitingCapacityReports".into()));

    // Every pod verified but not yet Ready: verified, not promoted.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), false);
    let plan = pass(&mut d, "r1", &world);
    assert!(plan.pod_gates.iter().all(|g| g.status == "True" && g.reason == "KVPoolVerified"), "{:?}", plan.pod_gates);
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (None, "Progressing"));
    assert_eq!(condition(&plan, CAPACITY_VERIFIED), (true, "KVPoolVerified".into()));

    // Ready at full strength: promoted, announced once, settled.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), true);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!((plan.status.current_revision.as_deref(), plan.status.current_context_window), (Some("r1"), Some(WINDOW)));
    assert_eq!((phase(&plan), plan.settled, plan.router_window), ("Available", true, Some(WINDOW)));
    assert_eq!(plan.events.iter().map(|e| (e.warning, e.reason)).collect::<Vec<_>>(), [(false, "RolloutVerified")]);
    assert_eq!(condition(&plan, AVAILABLE), (true, "Serving".into()));
    assert_eq!(plan.status.prefill.as_ref().unwrap().min_measured_tokens, Some(8192));

    // The same world again: no event, no pod condition to write, the same status.
    let again = pass(&mut d, "r1", &world_with_conditions(&world, &plan));
    assert!(again.events.is_empty() && again.pod_gates.is_empty(), "{again:?}");
    assert_eq!(again.status.conditions, plan.status.conditions);
}

/// The world after a plan's pod conditions were written.
fn world_with_conditions(world: &World, plan: &Plan) -> World {
    let mut w = world.clone();
    for pod in &mut w.pods {
        if let Some(g) = plan.pod_gates.iter().find(|g| g.pod == pod.name) {
            pod.condition = Some(k8s_openapi::api::core::v1::PodCondition {
                type_: gate::CONDITION.into(),
                status: g.status.into(),
                reason: Some(g.reason.clone()),
                message: Some(g.message.clone()),
                ..Default::default()
            });
        }
    }
    w
}

#[test]
fn the_incident_is_refused_scaled_to_zero_and_counted_once() {
    let mut d = deployment(1_048_576);
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(681_280, "l")), false);
    let plan = pass(&mut d, "r1", &world);
    let refused = plan.status.refused_revision.clone().unwrap();
    assert_eq!(refused.reason, "KVPoolBelowContextWindow");
    assert_eq!(refused.message, "prefill pod llm-prefill-r1-0 measured 681280 tokens < contextWindow 1048576");
    assert_eq!(sizes(&plan), [(Role::Prefill, "r1", 0), (Role::Decode, "r1", 0)]);
    assert_eq!((phase(&plan), plan.settled, plan.refused_reason.as_deref()), ("Refused", true, Some("KVPoolBelowContextWindow")));
    assert_eq!(plan.events[0].note, format!("revision r1 refused: {}; no revision serves yet", refused.message));
    assert_eq!(condition(&plan, ROLLOUT_REFUSED), (true, "KVPoolBelowContextWindow".into()));
    assert_eq!(condition(&plan, AVAILABLE), (false, "RolloutRefused".into()));
    assert_eq!(plan.pod_gates[0].reason, "KVPoolBelowContextWindow");

    // Next pass, pods going away: still refused, at zero, but not counted or announced again.
    let plan = pass(&mut d, "r1", &World::default());
    assert_eq!((plan.refused_reason.clone(), plan.events.len(), phase(&plan)), (None, 0, "Refused"));
    assert_eq!(sizes(&plan), [(Role::Prefill, "r1", 0), (Role::Decode, "r1", 0)]);
    assert_eq!(plan.status.prefill.as_ref().unwrap().min_measured_tokens, Some(681_280), "what the refused pods measured is kept");
}

/// A deployment serving revision r1 (verified, Ready), as status and world.
fn serving_r1() -> (InferenceDeployment, World) {
    let mut d = deployment(WINDOW);
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), true);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!(plan.status.current_revision.as_deref(), Some("r1"));
    (d, world)
}

#[test]
fn an_update_refused_while_the_old_revision_keeps_serving_untouched() {
    let (mut d, mut world) = serving_r1();
    d.spec.context_window = 16_384;
    revision(&mut world, &d, "r2", Ok(report(8192, "l")), false);
    let plan = pass(&mut d, "r2", &world);
    assert_eq!(plan.status.refused_revision.as_ref().map(|r| r.revision.as_str()), Some("r2"));
    assert_eq!(sizes(&plan), [(Role::Prefill, "r2", 0), (Role::Decode, "r2", 0)], "only the candidate is scaled");
    assert!(plan.delete.is_empty(), "the serving revision's Deployments stay: {:?}", plan.delete);
    assert_eq!((plan.status.current_revision.as_deref(), plan.router_window), (Some("r1"), Some(WINDOW)), "the router keeps r1's window");
    assert!(plan.events[0].note.ends_with("; revision r1 keeps serving"), "{}", plan.events[0].note);
    assert_eq!(phase(&plan), "Refused");
    assert_eq!(condition(&plan, AVAILABLE), (true, "Serving".into()));
    // The status describes the serving revision's pods, verified against its own window.
    assert_eq!(plan.status.prefill.as_ref().unwrap().revision.as_deref(), Some("r1"));
    assert!(plan.pod_gates.iter().filter(|g| g.pod.contains("-r1-")).all(|g| g.status == "True"), "{:?}", plan.pod_gates);
}

#[test]
fn a_fix_rolls_forward_and_retires_the_old_and_the_refused_revisions() {
    let (mut d, mut world) = serving_r1();
    d.spec.context_window = 16_384;
    let mut refused_world = world.clone();
    revision(&mut refused_world, &d, "r2", Ok(report(8192, "l")), false);
    pass(&mut d, "r2", &refused_world);
    // The fix: a window the pools hold, a new revision r3; r2's Deployments still exist.
    d.spec.context_window = 4096;
    world.deployments.extend(refused_world.deployments.iter().filter(|x| x.revision == "r2").cloned());
    let plan = pass(&mut d, "r3", &world);
    assert_eq!(sizes(&plan), [(Role::Prefill, "r3", 1), (Role::Decode, "r3", 2)]);
    assert_eq!(plan.delete, ["llm-prefill-r2", "llm-decode-r2"], "the refused revision is neither serving nor the candidate");
    assert_eq!((phase(&plan), plan.status.candidate_revision.as_deref()), ("Progressing", Some("r3")));
    revision(&mut world, &d, "r3", Ok(report(8192, "l")), true);
    world.deployments.retain(|x| x.revision != "r2");
    let plan = pass(&mut d, "r3", &world);
    assert_eq!((plan.status.current_revision.as_deref(), plan.status.current_context_window), (Some("r3"), Some(4096)));
    assert_eq!(plan.delete, ["llm-prefill-r1", "llm-decode-r1"], "promotion retires the old revision");
    assert_eq!(plan.status.refused_revision.as_ref().map(|r| r.revision.as_str()), Some("r2"), "the record of r2 stays");
    assert!(!condition(&plan, ROLLOUT_REFUSED).0, "but it no longer stands");
    assert_eq!(phase(&plan), "Available");
}

#[test]
fn a_fingerprint_mismatch_between_roles_is_refused() {
    let mut d = deployment(WINDOW);
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l-bf16")), false);
    let plan = pass(&mut d, "r1", &world);
    let refused = plan.status.refused_revision.unwrap();
    assert_eq!(refused.reason, "FingerprintMismatch");
    assert!(refused.message.contains("m/l-bf16") && refused.message.ends_with("the decode pods have m/l"), "{}", refused.message);
}

#[test]
fn a_verified_candidate_below_full_strength_is_not_promoted() {
    let (mut d, mut world) = serving_r1();
    d.spec.context_window = 4096;
    revision(&mut world, &d, "r2", Ok(report(8192, "l")), true);
    // One decode pod of r2 has not been created yet.
    world.pods.retain(|p| p.name != "llm-decode-r2-1");
    let plan = pass(&mut d, "r2", &world);
    assert_eq!((plan.status.current_revision.as_deref(), plan.settled, phase(&plan)), (Some("r1"), false, "Progressing"));
    assert_eq!(condition(&plan, PROGRESSING), (true, "VerifyingKVPools".into()));
    assert!(plan.delete.is_empty());
}

#[test]
fn a_host_path_outside_the_allowed_directories_creates_nothing() {
    let mut d = deployment(WINDOW);
    let message = "spec.model.hostPath /etc is not under --allowed-host-paths";
    let plan = decide(Inputs { d: &d, revision: "r1", host_path_refusal: Some(message), world: &World::default() });
    assert!(plan.workers.is_empty() && plan.router_window.is_none(), "{plan:?}");
    assert_eq!(plan.refused_reason.as_deref(), Some(crate::host_paths::REASON));
    assert_eq!(plan.events[0].note, format!("revision r1 refused, no pod created: {message}"));
    d.status = Some(plan.status);
    let again = decide(Inputs { d: &d, revision: "r1", host_path_refusal: Some(message), world: &World::default() });
    assert_eq!((again.refused_reason, again.events.len()), (None, 0), "refused once");
    assert!(conditions::is_true(&again.status.conditions, ROLLOUT_REFUSED));
}
