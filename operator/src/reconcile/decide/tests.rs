//! Every transition of the rollout, as `decide` sees it: a spec, the status the last pass wrote,
//! and the pods and Deployments found. Each test chains passes the way the operator runs them,
//! feeding each pass's status to the next.

use std::collections::BTreeMap;

pub(super) use kvgate_proto::CapacityReport;

pub(super) use super::*;
use crate::canary::Target;
use crate::conditions::{self, AVAILABLE, CAPACITY_VERIFIED, PROGRESSING, ROLLOUT_REFUSED};
pub(super) use crate::gate::{self, Measured, Role};
pub(super) use crate::reconcile::observe::{NoReport, OwnedDeployment, WorkerPod, World};
use crate::render::workers;
use crate::tasks::counter_watch::CounterWatch;

pub(super) const WINDOW: u64 = 2048;

pub(super) fn deployment(window: u64) -> InferenceDeployment {
    let spec = serde_json::json!({
        "model": { "name": "tiny" }, "contextWindow": window,
        "prefill": { "replicas": 1, "kvPool": { "tokens": 8192 } },
        "decode": { "replicas": 2, "kvPool": { "tokens": 8192 } },
        // Off here; the canary's transitions have their own tests below, with it on.
        "rollout": { "canary": { "prompts": 0 }, "bakeSeconds": 0 },
    });
    let mut d = InferenceDeployment::for_test(spec);
    d.metadata.generation = Some(1);
    d
}

pub(super) fn report(tokens: u64, layout: &str) -> Measured {
    Measured::Kvgate(CapacityReport {
        capacity_tokens: tokens,
        page_size: 16,
        num_pages: tokens / 16,
        bytes_per_token: 512,
        device: "cpu".into(),
        dtype: "f32".into(),
        model: "tiny".into(),
        model_fingerprint: "m".into(),
        layout_fingerprint: layout.into(),
        vocab_size: Some(258),
        instance: String::new(),
        prefill_timings: None,
    })
}

/// The pods and Deployments of one revision: one prefill, two decode, each reporting `tokens`
/// (prefill) and 8192 (decode), all Ready when `ready`.
pub(super) fn revision(world: &mut World, d: &InferenceDeployment, rev: &str, prefill: Result<Measured, NoReport>, ready: bool) {
    for (role, n, rep) in [(Role::Prefill, 1, prefill), (Role::Decode, 2, Ok(report(8192, "l")))] {
        for i in 0..n {
            let name = format!("{}-{i}", workers::deployment_name(d, role, rev));
            let ip = Some(format!("10.0.{}.{i}", d.spec.port(role) - 8080));
            world.pods.push(WorkerPod { name, role, revision: rev.into(), ip, report: rep.clone(), condition: None, containers_ready: true });
        }
        let image = Some(format!("worker:{rev}"));
        world.deployments.push(OwnedDeployment { name: workers::deployment_name(d, role, rev), revision: rev.into(), ready: if ready { n } else { 0 }, image });
    }
    world.router_ready = Some(1);
}

pub(super) fn pass(d: &mut InferenceDeployment, rev: &str, world: &World) -> Plan {
    pass_at(d, rev, world, 1_000)
}

/// One pass at `second` (Unix time): bakes are timed against it.
pub(super) fn pass_at(d: &mut InferenceDeployment, rev: &str, world: &World, second: i64) -> Plan {
    let now = Time(k8s_openapi::jiff::Timestamp::from_second(second).unwrap());
    let plan = decide(Inputs { d, revision: rev, host_path_refusal: None, world, now: &now });
    d.status = Some(plan.status.clone());
    plan
}

pub(super) fn condition(plan: &Plan, type_: &str) -> (bool, String) {
    let c = plan.status.conditions.iter().find(|c| c.type_ == type_).unwrap_or_else(|| panic!("no {type_}"));
    (c.status == "True", c.reason.clone())
}

pub(super) fn phase(plan: &Plan) -> &'static str {
    plan.status.phase.unwrap().as_str()
}

pub(super) fn sizes(plan: &Plan) -> Vec<(Role, &str, i32)> {
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
    assert_eq!((prefill.status(), prefill.reason.as_str()), ("False", "AwaitingCapacityReport"));
    assert_eq!(prefill.message, "GET http://10.0.0.1:8081/v1/kv-pool: connection refused");
    assert!(plan.pod_gates[1].message.contains("waiting for the prefill pods"), "{:?}", plan.pod_gates[1]);
    assert_eq!(condition(&plan, CAPACITY_VERIFIED), (false, "AwaitingCapacityReports".into()));

    // Every pod verified but not yet Ready: verified, not promoted.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), false);
    let plan = pass(&mut d, "r1", &world);
    assert!(plan.pod_gates.iter().all(|g| g.verified && g.reason == "KVPoolVerified"), "{:?}", plan.pod_gates);
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (None, "Progressing"));
    assert_eq!(plan.status.reason.as_deref(), Some("VerifyingKVPools"), "the printer column's reason");
    assert_eq!(condition(&plan, CAPACITY_VERIFIED), (true, "KVPoolVerified".into()));

    // Ready at full strength: promoted, announced once, settled.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), true);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!((plan.status.current_revision.as_deref(), plan.status.current_context_window), (Some("r1"), Some(WINDOW)));
    assert_eq!((phase(&plan), plan.settled, plan.router_window, plan.status.reason.as_deref()), ("Available", true, Some(WINDOW), None));
    assert_eq!(plan.events.iter().map(|e| (e.warning, e.reason.as_str())).collect::<Vec<_>>(), [(false, "RolloutVerified")]);
    assert_eq!(condition(&plan, AVAILABLE), (true, "Serving".into()));
    assert_eq!(plan.status.prefill.as_ref().unwrap().min_measured_tokens, Some(8192));

    // The same world again: no event, no pod condition to write, the same status.
    let again = pass(&mut d, "r1", &world_with_conditions(&world, &plan));
    assert!(again.events.is_empty() && again.pod_gates.is_empty(), "{again:?}");
    assert_eq!(again.status.conditions, plan.status.conditions);
}

/// The world after a plan's pod conditions were written.
pub(super) fn world_with_conditions(world: &World, plan: &Plan) -> World {
    let mut w = world.clone();
    for pod in &mut w.pods {
        if let Some(g) = plan.pod_gates.iter().find(|g| g.pod == pod.name) {
            pod.condition = Some(k8s_openapi::api::core::v1::PodCondition {
                type_: gate::CONDITION.into(),
                status: g.status().into(),
                reason: Some(g.reason.as_str().into()),
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
    assert_eq!(refused.reason, RefusalReason::KVPoolBelowContextWindow);
    assert_eq!(refused.message, "prefill pod llm-prefill-r1-0 measured 681280 tokens < contextWindow 1048576");
    assert_eq!(sizes(&plan), [(Role::Prefill, "r1", 0), (Role::Decode, "r1", 0)]);
    assert_eq!((phase(&plan), plan.settled, plan.refused_reason), ("Refused", true, Some(RefusalReason::KVPoolBelowContextWindow)));
    assert_eq!(plan.status.reason.as_deref(), Some("KVPoolBelowContextWindow"), "the printer column's reason");
    assert_eq!(plan.events[0].note, format!("revision r1 refused: {}; no revision serves yet", refused.message));
    assert_eq!(condition(&plan, ROLLOUT_REFUSED), (true, "KVPoolBelowContextWindow".into()));
    assert_eq!(condition(&plan, AVAILABLE), (false, "RolloutRefused".into()));
    assert_eq!(plan.pod_gates[0].reason, "KVPoolBelowContextWindow");

    // Next pass, pods going away: still refused, at zero, but not counted or announced again.
    let plan = pass(&mut d, "r1", &World::default());
    assert_eq!((plan.refused_reason, plan.events.len(), phase(&plan)), (None, 0, "Refused"));
    assert_eq!(sizes(&plan), [(Role::Prefill, "r1", 0), (Role::Decode, "r1", 0)]);
    assert_eq!(plan.status.prefill.as_ref().unwrap().min_measured_tokens, Some(681_280), "what the refused pods measured is kept");
}

/// A deployment serving revision r1 (verified, Ready), as status and world.
pub(super) fn serving_r1() -> (InferenceDeployment, World) {
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
    assert_eq!(plan.router_image.as_deref(), Some("worker:r1"), "and r1's image");
    assert!(plan.events[0].note.ends_with("; revision r1 keeps serving"), "{}", plan.events[0].note);
    assert_eq!(phase(&plan), "Refused");
    assert_eq!(condition(&plan, AVAILABLE), (true, "Serving".into()));
    // The status describes the serving revision's pods, verified against its own window.
    assert_eq!(plan.status.prefill.as_ref().unwrap().revision.as_deref(), Some("r1"));
    assert!(plan.pod_gates.iter().filter(|g| g.pod.contains("-r1-")).all(|g| g.verified), "{:?}", plan.pod_gates);
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
    assert_eq!(refused.reason, RefusalReason::FingerprintMismatch);
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
    let plan = decide(Inputs {
        d: &d,
        revision: "r1",
        host_path_refusal: Some(message),
        world: &World::default(),
        now: &Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    });
    assert!(plan.workers.is_empty() && plan.router_window.is_none(), "{plan:?}");
    assert_eq!(plan.refused_reason, Some(RefusalReason::HostPathNotAllowed));
    assert_eq!(plan.events[0].note, format!("revision r1 refused, no pod created: {message}"));
    d.status = Some(plan.status);
    let again = decide(Inputs {
        d: &d,
        revision: "r1",
        host_path_refusal: Some(message),
        world: &World::default(),
        now: &Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    });
    assert_eq!((again.refused_reason, again.events.len()), (None, 0), "refused once");
    assert!(conditions::is_true(&again.status.conditions, ROLLOUT_REFUSED));
}

pub(super) fn canary_on(d: &mut InferenceDeployment) {
    d.spec.rollout.canary = crate::crd::CanarySpec::default();
}

pub(super) fn canary_result(d: &mut InferenceDeployment, rev: &str, passed: bool, message: &str) {
    d.status.as_mut().unwrap().canary =
        Some(crate::crd::CanaryStatus { revision: rev.into(), passed, message: message.into(), reason: (!passed).then_some(RefusalReason::CanaryFailed) });
}

#[test]
fn a_first_revision_takes_no_traffic_until_its_canary_passed() {
    let mut d = deployment(WINDOW);
    canary_on(&mut d);
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(report(8192, "l")), false);
    let plan = pass(&mut d, "r1", &world);
    // Every pool verified: the gates stay False while the canary runs over all 1 x 2 pairs.
    assert!(plan.pod_gates.iter().all(|g| !g.verified && g.reason == "AwaitingCanary"), "{:?}", plan.pod_gates);
    assert_eq!(phase(&plan), "Canary");
    let run = plan.canary.clone().expect("a canary to run");
    let Target::Pairs { prefill, decode } = &run.target else { panic!("{run:?}") };
    assert_eq!((run.revision.as_str(), prefill.len(), decode.len(), run.reference.clone()), ("r1", 1, 2, None));
    assert_eq!((run.prompts, run.page_size, run.vocab, run.max_tokens), (3, 16, 258, 8));
    assert_eq!(run.max_prompt_tokens, WINDOW - 8, "the longest prompt leaves room for the generated tokens");
    assert_eq!(decode[1].ip, "10.0.2.1");
    assert_eq!(run.boundary, Some(crate::canary::Boundary { window: WINDOW, full: true }), "the boundary probes, by default");
    d.spec.rollout.boundary_probe.max_prompt_tokens = WINDOW - 1;
    assert_eq!(pass(&mut d.clone(), "r1", &world).canary.unwrap().boundary.map(|b| b.full), Some(false), "a window beyond the budget: window + 1 only");
    d.spec.rollout.boundary_probe.canary = false;
    assert_eq!(pass(&mut d.clone(), "r1", &world).canary.unwrap().boundary, None);

    // Passed: the gates open; once Ready at full strength the revision serves.
    canary_result(&mut d, "r1", true, "3 prompts ... no integrity counter moved");
    let plan = pass(&mut d, "r1", &world_with_conditions(&world, &plan));
    assert!(plan.canary.is_none());
    assert!(plan.pod_gates.iter().all(|g| g.verified), "{:?}", plan.pod_gates);
    let mut ready = World::default();
    revision(&mut ready, &d, "r1", Ok(report(8192, "l")), true);
    let plan = pass(&mut d, "r1", &world_with_conditions(&ready, &plan));
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (Some("r1"), "Available"));
    assert_eq!(plan.status.canary.as_ref().map(|c| c.passed), Some(true), "the canary's result stays in status");
}

#[test]
fn a_failed_canary_refuses_the_candidate_and_the_serving_revision_is_its_reference() {
    let (mut d, world) = serving_r1();
    let mut world = world_with_conditions(&world, &pass(&mut d.clone(), "r1", &world));
    canary_on(&mut d);
    d.spec.decode.as_mut().unwrap().kv_pool.as_mut().unwrap().tokens = Some(16_384);
    revision(&mut world, &d, "r2", Ok(report(8192, "l")), false);
    let plan = pass(&mut d, "r2", &world);
    let run = plan.canary.clone().expect("a canary to run");
    let r = run.reference.clone().expect("r1 has the same model and layout");
    let Target::Pairs { prefill, decode } = &r.target else { panic!("{r:?}") };
    assert_eq!((r.revision.as_str(), prefill[0].pod.as_str(), decode[0].pod.as_str(), r.context_window), ("r1", "llm-prefill-r1-0", "llm-decode-r1-0", WINDOW));
    assert_eq!((prefill.len(), decode.len()), (1, 1), "one serving pair is the reference");

    let message = "pair prefill llm-prefill-r2-0 x decode llm-decode-r2-1, prompt of 128 tokens: output token 2 is token id 7, but serving revision r1 (prefill llm-prefill-r1-0 x decode llm-decode-r1-0) gave token id 9";
    canary_result(&mut d, "r2", false, message);
    let plan = pass(&mut d, "r2", &world);
    let refused = plan.status.refused_revision.clone().unwrap();
    assert_eq!((refused.revision.as_str(), refused.reason, refused.message.as_str()), ("r2", RefusalReason::CanaryFailed, message));
    assert_eq!(plan.refused_reason, Some(RefusalReason::CanaryFailed));
    assert_eq!(sizes(&plan), [(Role::Prefill, "r2", 0), (Role::Decode, "r2", 0)]);
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (Some("r1"), "Refused"));
    assert!(plan.events[0].note.contains("integrity canary failed") && plan.events[0].note.ends_with("revision r1 keeps serving"), "{:?}", plan.events);
    assert!(plan.canary.is_none(), "not run again");

    // An answer past the window refuses under its own reason, announced as such.
    let (mut d2, world2) = serving_r1();
    canary_on(&mut d2);
    d2.spec.decode.as_mut().unwrap().kv_pool.as_mut().unwrap().tokens = Some(16_384);
    let mut world2 = world_with_conditions(&world2, &pass(&mut d2.clone(), "r1", &world2));
    revision(&mut world2, &d2, "r2", Ok(report(8192, "l")), false);
    pass(&mut d2, "r2", &world2);
    let answered = "llamacpp pod s-0: a prompt of 4097 tokens (contextWindow 4096 + 1) was answered with 1 tokens [5]";
    d2.status.as_mut().unwrap().canary =
        Some(crate::crd::CanaryStatus { revision: "r2".into(), passed: false, message: answered.into(), reason: Some(RefusalReason::BoundaryProbeAnswered) });
    let plan = pass(&mut d2, "r2", &world2);
    assert_eq!(plan.refused_reason, Some(RefusalReason::BoundaryProbeAnswered));
    assert_eq!(plan.status.refused_revision.as_ref().map(|r| r.message.as_str()), Some(answered));

    // A serving revision of another layout is no reference: its outputs may differ by design.
    let (mut d, world) = serving_r1();
    canary_on(&mut d);
    let mut world = world_with_conditions(&world, &pass(&mut d.clone(), "r1", &world));
    d.spec.prefill.as_mut().unwrap().kv_pool.as_mut().unwrap().dtype = "bf16".into();
    revision(&mut world, &d, "r3", Ok(report(8192, "l-bf16")), false);
    for p in world.pods.iter_mut().filter(|p| p.revision == "r3") {
        p.report = Ok(report(8192, "l-bf16"));
    }
    let plan = pass(&mut d, "r3", &world);
    assert_eq!(plan.canary.expect("a canary").reference, None);
}

#[test]
fn a_serving_pod_that_restarts_smaller_is_unverified_at_once_and_the_deployment_degraded() {
    let (mut d, world) = serving_r1();
    let plan = pass(&mut d, "r1", &world);
    let world = world_with_conditions(&world, &plan);
    assert_eq!(condition(&plan, conditions::DEGRADED), (false, "ServingPodsVerified".into()));
    // The prefill pod came back from a restart with an eighth of its pool.
    let mut restarted = world.clone();
    restarted.pods.iter_mut().find(|p| p.role == Role::Prefill).unwrap().report = Ok(report(1024, "l"));
    let plan = pass(&mut d, "r1", &restarted);
    let gate = plan.pod_gates.iter().find(|g| g.pod == "llm-prefill-r1-0").expect("the prefill pod's gate");
    assert_eq!((gate.status(), gate.reason.as_str()), ("False", "KVPoolBelowContextWindow"));
    assert_eq!(plan.unverified, ["prefill pod llm-prefill-r1-0 measured 1024 tokens < contextWindow 2048"]);
    assert_eq!(condition(&plan, conditions::DEGRADED), (true, "ServingPodUnverified".into()));
    // Still the serving revision; the phase and the printer column's reason say a pod is out.
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (Some("r1"), "Degraded"));
    assert_eq!(plan.status.reason.as_deref(), Some("ServingPodUnverified"));
    assert!(plan.refused_reason.is_none() && plan.delete.is_empty());
    assert_eq!((plan.events.len(), plan.events[0].reason.as_str(), plan.events[0].warning), (1, "ServingPodUnverified", true));
    // Announced once; when it passes again, the condition clears with a Normal Event.
    let again = pass(&mut d, "r1", &world_with_conditions(&restarted, &plan));
    assert!(again.events.is_empty(), "{:?}", again.events);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!(condition(&plan, conditions::DEGRADED), (false, "ServingPodsVerified".into()));
    assert_eq!(plan.events.iter().map(|e| e.reason).collect::<Vec<_>>(), ["ServingPodsVerified"]);
    assert_eq!((phase(&plan), plan.status.reason.as_deref()), ("Available", None));
}

pub(super) fn bake_from_r1(window: u64) -> (InferenceDeployment, World) {
    let (mut d, mut world) = serving_r1();
    d.spec.rollout.bake_seconds = 60;
    d.spec.rollout.max_handoff_mismatches = 0;
    d.spec.decode.as_mut().unwrap().kv_pool.as_mut().unwrap().tokens = Some(16_384);
    d.spec.context_window = window;
    revision(&mut world, &d, "r2", Ok(report(8192, "l")), true);
    world.mismatches = Some(BTreeMap::from([("timeout".to_string(), 1)]));
    (d, world)
}

#[test]
fn a_promotion_bakes_beside_the_previous_revision_and_mismatches_roll_it_back() {
    let (mut d, mut world) = bake_from_r1(4096);
    let plan = pass_at(&mut d, "r2", &world, 1_000);
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan), plan.settled), (Some("r2"), "Baking", false));
    assert!(plan.delete.is_empty(), "r1 stays beside r2 during the bake: {:?}", plan.delete);
    let b = plan.status.bake.clone().expect("a bake");
    assert_eq!((b.revision.as_str(), b.previous.as_str(), b.previous_context_window, b.mismatches_at_start), ("r2", "r1", WINDOW, 1));
    assert_eq!(plan.router_window, Some(4096));

    // Seconds later, nothing new: still baking.
    let plan = pass_at(&mut d, "r2", &world, 1_030);
    assert_eq!((phase(&plan), plan.events.len()), ("Baking", 0));
    // A checksum mismatch on any pod: r1 serves again with its window, r2 is refused and scaled away.
    world.mismatches = Some(BTreeMap::from([("timeout".to_string(), 1), ("checksum".to_string(), 1)]));
    let plan = pass_at(&mut d, "r2", &world, 1_031);
    assert_eq!((plan.status.current_revision.as_deref(), plan.router_window, phase(&plan)), (Some("r1"), Some(WINDOW), "RolledBack"));
    assert_eq!(plan.router_image.as_deref(), Some("worker:r1"));
    let refused = plan.status.refused_revision.clone().unwrap();
    assert_eq!((refused.revision.as_str(), refused.reason.as_str()), ("r2", "HandoffIntegrityViolation"));
    assert!(
        refused.message.starts_with("1 handoff mismatches during the bake of revision r2") && refused.message.contains("checksum 1"),
        "{}",
        refused.message
    );
    assert_eq!((plan.rollback, plan.refused_reason), (Some(RollbackReason::HandoffIntegrityViolation), Some(RefusalReason::HandoffIntegrityViolation)));
    assert_eq!(sizes(&plan), [(Role::Prefill, "r2", 0), (Role::Decode, "r2", 0)]);
    assert!(plan.delete.is_empty() && plan.status.bake.is_none());
    assert_eq!(plan.events.iter().map(|e| (e.reason.as_str(), e.warning)).collect::<Vec<_>>(), [("RolledBack", true)]);
    assert_eq!(condition(&plan, ROLLOUT_REFUSED), (true, "HandoffIntegrityViolation".into()));
    assert!(refused.rolled_back, "it served: RolledBack, not Refused");
    // Not counted or announced twice.
    let plan = pass_at(&mut d, "r2", &world, 1_033);
    assert_eq!((plan.rollback, plan.events.len(), phase(&plan)), (None, 0, "RolledBack"));
}

#[test]
fn a_clean_bake_retires_the_previous_revision() {
    let (mut d, world) = bake_from_r1(WINDOW);
    pass_at(&mut d, "r2", &world, 1_000);
    let plan = pass_at(&mut d, "r2", &world, 1_059);
    assert_eq!(phase(&plan), "Baking");
    let plan = pass_at(&mut d, "r2", &world, 1_060);
    assert_eq!((phase(&plan), plan.settled, plan.status.bake.clone()), ("Available", true, None));
    assert_eq!(plan.delete, ["llm-prefill-r1", "llm-decode-r1"]);
    assert_eq!(plan.events.iter().map(|e| e.reason).collect::<Vec<_>>(), ["BakeComplete"]);
}

#[test]
fn a_window_prefill_cannot_finish_before_the_handoff_timeout_is_flagged_once_and_refuses_nothing() {
    let mut d = deployment(WINDOW);
    let timed = |micros: [u64; 2]| {
        let Measured::Kvgate(r) = report(8192, "l") else { unreachable!() };
        Measured::Kvgate(CapacityReport { prefill_timings: Some(kvgate_proto::PrefillTimings { tokens: [512, 1024], micros }), ..r })
    };
    // 512 tokens in 10 s, 1024 in 20 s (a slow machine): 40 s for the window of 2048, past 30 s.
    let mut world = World::default();
    revision(&mut world, &d, "r1", Ok(timed([10_000_000, 20_000_000])), true);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!(condition(&plan, conditions::PREFILL_WITHIN_DEADLINE), (false, "WindowExceedsHandoffTimeout".into()));
    let c = plan.status.conditions.iter().find(|c| c.type_ == conditions::PREFILL_WITHIN_DEADLINE).unwrap();
    assert!(c.message.contains("about 40 s, past the handoff timeout of 30 s") && c.message.contains("over about 1536 tokens"), "{}", c.message);
    assert!(plan.events.iter().any(|e| e.warning && e.reason == "PrefillSlowerThanHandoffTimeout"), "{:?}", plan.events);
    assert_eq!(plan.status.current_revision.as_deref(), Some("r1"), "advisory: the revision still serves");
    // Said once; the next pass keeps the condition without a second event.
    let again = pass(&mut d, "r1", &world_with_conditions(&world, &plan));
    assert!(!again.events.iter().any(|e| e.reason == "PrefillSlowerThanHandoffTimeout"), "{:?}", again.events);
    // A longer timeout (or a faster prefill) turns it True.
    d.spec.handoff.timeout_ms = 60_000;
    let plan = pass(&mut d, "r1", &world);
    assert_eq!(condition(&plan, conditions::PREFILL_WITHIN_DEADLINE), (true, "WithinHandoffTimeout".into()));
}

#[test]
fn serving_pods_are_probed_and_one_a_probe_caught_is_out_and_degraded() {
    let (mut d, world) = serving_r1();
    let world = world_with_conditions(&world, &pass(&mut d.clone(), "r1", &world));
    let plan = pass(&mut d, "r1", &world);
    let run = plan.serving_probe.clone().expect("serving probes, by default");
    assert_eq!((run.revision.as_str(), run.window, run.every_seconds, run.reference.len()), ("r1", WINDOW, 300, 64));
    let Target::Pairs { prefill, decode } = &run.target else { panic!("{run:?}") };
    assert_eq!((prefill.len(), decode.len()), (1, 2));
    let mut off = d.clone();
    off.spec.rollout.boundary_probe.serving_every_seconds = 0;
    assert!(pass(&mut off, "r1", &world).serving_probe.is_none());

    let mut caught = world.clone();
    let message = "stale KV: pair prefill llm-prefill-r1-0 x decode llm-decode-r1-0, the reference prompt of 64 tokens beside live traffic: output token 0 is token id 3, but it gave token id 4 before";
    caught.probe_failures.insert("llm-decode-r1-0".into(), (RefusalReason::CanaryFailed, message.into()));
    let plan = pass(&mut d, "r1", &caught);
    let gate = plan.pod_gates.iter().find(|g| g.pod == "llm-decode-r1-0").expect("its gate");
    assert_eq!((gate.status(), gate.reason.as_str(), gate.message.as_str()), ("False", "CanaryFailed", message));
    assert!(conditions::is_true(&plan.status.conditions, conditions::DEGRADED));
    assert_eq!(plan.unverified, [message]);
    assert_eq!(plan.status.current_revision.as_deref(), Some("r1"), "the serving revision keeps serving on its other pods");
}

#[test]
fn the_counters_are_scraped_fast_for_a_promotion_or_a_bake_slowly_while_serving_and_a_partial_scrape_is_no_baseline() {
    use crate::tasks::scrapes::{EVERY, SERVING_EVERY};
    let quiet = std::time::Duration::from_secs(60);
    // Serving r1 and nothing in flight: every KV pod, at the serving pace.
    let (mut d, world) = serving_r1();
    d.spec.rollout.bake_seconds = 60;
    let (targets, pace) = pass(&mut d, "r1", &world).scrape.expect("a serving revision's counters are watched");
    assert_eq!((targets.len(), pace.every, pace.quiet), (3, SERVING_EVERY, quiet), "{targets:?}");
    // Nothing serves yet: nothing to watch.
    let mut fresh = deployment(WINDOW);
    assert_eq!(pass(&mut fresh, "r1", &World::default()).scrape, None);

    // r2 verified and ready over r1: its baseline is wanted from every worker pod of both.
    let (mut d, mut world) = bake_from_r1(4096);
    world.mismatches = None;
    let plan = pass_at(&mut d.clone(), "r2", &world, 1_000);
    let (scraped, pace) = plan.scrape.expect("counters wanted before a promotion that bakes");
    assert_eq!(scraped.len(), world.pods.iter().filter(|p| p.role.holds_kv()).count(), "{scraped:?}");
    assert_eq!(pace.every, EVERY, "a promotion's baseline and its bake are read twice a second");
    assert_eq!(plan.status.current_revision.as_deref(), Some("r1"), "no promotion before the baseline is read");

    // A scrape that missed a pod is no baseline either; a whole one is.
    world.mismatches = Some(BTreeMap::from([("timeout".to_string(), 1)]));
    world.mismatches_partial = true;
    assert_eq!(pass_at(&mut d.clone(), "r2", &world, 1_000).status.current_revision.as_deref(), Some("r1"));
    world.mismatches_partial = false;
    let plan = pass_at(&mut d, "r2", &world, 1_000);
    assert_eq!((plan.status.current_revision.as_deref(), phase(&plan)), (Some("r2"), "Baking"));
    assert_eq!(plan.scrape.map(|(_, pace)| pace.every), Some(EVERY), "a bake is judged on the counters");

    // An external engine has no counters: nothing is ever scraped.
    let mut engine = InferenceDeployment::for_test(serde_json::json!({
        "engine": "vllm", "model": { "name": "tiny" }, "contextWindow": WINDOW, "server": { "container": { "name": "vllm", "image": "v" } },
        "rollout": { "canary": { "prompts": 0 }, "bakeSeconds": 60 },
    }));
    assert_eq!(pass(&mut engine, "r1", &World::default()).scrape, None);
}

/// A disaggregated vLLM: one prefill, one decode and a router, canary and bake on.
pub(super) fn vllm_pd() -> InferenceDeployment {
    let container = serde_json::json!({ "name": "vllm", "image": "v" });
    let mut d = InferenceDeployment::for_test(serde_json::json!({
        "engine": "vllm", "model": { "name": "m" }, "contextWindow": WINDOW,
        "prefill": { "replicas": 1, "container": container }, "decode": { "replicas": 1, "container": container },
        "router": { "replicas": 1, "container": container },
        "rollout": { "canary": { "prompts": 2 }, "bakeSeconds": 60 },
    }));
    d.metadata.generation = Some(1);
    d
}

/// A vLLM revision's pods: prefill and decode reading `max_model_len` 4096, the router ready
/// once the gate let its KV pods through (as the canary asks only listening routers).
fn vllm_revision(world: &mut World, d: &InferenceDeployment, rev: &str) {
    let capacity = |role: Role| {
        Ok(Measured::Engine(crate::engines::EngineCapacity {
            engine: crate::crd::Engine::Vllm,
            tokens: 4096,
            field: "max_model_len".into(),
            model: "m".into(),
            detail: format!("{} pod", role.as_str()),
        }))
    };
    for (n, role) in [Role::Prefill, Role::Decode, Role::Router].into_iter().enumerate() {
        let report = if role.holds_kv() { capacity(role) } else { Err(NoReport::waiting("a router holds no KV")) };
        let name = format!("{}-0", workers::deployment_name(d, role, rev));
        let ip = Some(format!("10.1.{n}.{}", rev.len()));
        world.pods.push(WorkerPod { name, role, revision: rev.into(), ip, report, condition: None, containers_ready: true });
        world.deployments.push(OwnedDeployment {
            name: workers::deployment_name(d, role, rev),
            revision: rev.into(),
            ready: 1,
            image: Some(format!("v:{rev}")),
        });
    }
}

/// Passes until the plan asks for no canary (the run `passed` handed back as the task would).
fn through_canary(d: &mut InferenceDeployment, rev: &str, world: &mut World, second: i64) -> Plan {
    let mut plan = pass_at(d, rev, world, second);
    for _ in 0..4 {
        *world = world_with_conditions(world, &plan);
        if let Some(run) = &plan.canary {
            world.canary = Some(CanaryStatus { revision: run.revision.clone(), passed: true, message: "clean".into(), reason: None });
        }
        plan = pass_at(d, rev, world, second);
    }
    plan
}

/// The operator judges a disaggregated vLLM on its own pods' counters: the canary reads every
/// KV pod's NIXL and connector counters, a promotion bakes on them, and growth on one pod rolls
/// the revision back with the engine's counter named, read from a `/metrics` body as the
/// scrape reads it.
#[test]
fn a_disaggregated_vllm_is_canaried_and_baked_on_its_engines_counters() {
    let mut d = vllm_pd();
    let mut world = World::default();
    vllm_revision(&mut world, &d, "r1");
    let plan = pass(&mut d, "r1", &world);
    let world1 = world_with_conditions(&world, &plan);
    let run = pass(&mut d, "r1", &world1).canary.expect("a canary for r1");
    let counted: Vec<(&str, Role, u16)> = run.counted.iter().map(|c| (c.pod.as_str(), c.role, c.port)).collect();
    assert_eq!(counted, [("llm-prefill-r1-0", Role::Prefill, 8000), ("llm-decode-r1-0", Role::Decode, 8000)], "every KV pod, not the router");
    assert_eq!(
        run.counters.iter().map(|c| c.family).collect::<Vec<_>>(),
        ["kvgate_handoff_mismatch_total", "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_notifications_after_expiry_total"]
    );
    let plan = through_canary(&mut d, "r1", &mut world, 1_000);
    assert_eq!((phase(&plan), plan.status.current_revision.as_deref()), ("Available", Some("r1")), "{:?}", plan.status);

    // r2: its canary passes, its promotion bakes beside r1 and the counters are scraped.
    d.spec.decode.as_mut().unwrap().container.as_mut().unwrap().image = Some("v2".into());
    world.mismatches = Some(BTreeMap::new());
    vllm_revision(&mut world, &d, "r2");
    let plan = through_canary(&mut d, "r2", &mut world, 1_000);
    assert_eq!((phase(&plan), plan.status.current_revision.as_deref()), ("Baking", Some("r2")), "{:?}", plan.status);
    let (scraped, _) = plan.scrape.expect("a bake is judged on the engine's counters");
    assert_eq!(scraped.len(), 4, "both revisions' KV pods: {scraped:?}");

    // r2's decode counts NIXL failures and blocks the connector refused: r1 serves again.
    let body = include_str!("../../engines/testdata/vllm-decode-metrics-integrity.txt");
    let decode = crate::engines::integrity::read(body, d.spec.engine().integrity_counters(&d.spec));
    world.mismatches = Some(decode.clone());
    world.mismatches_by_pod = BTreeMap::from([("llm-decode-r2-0".to_string(), decode)]);
    let plan = pass_at(&mut d, "r2", &world, 1_010);
    assert_eq!((phase(&plan), plan.status.current_revision.as_deref()), ("RolledBack", Some("r1")));
    let refused = plan.status.refused_revision.clone().unwrap();
    assert_eq!(refused.reason, RefusalReason::HandoffIntegrityViolation);
    assert!(refused.message.contains("pod llm-decode-r2-0: checksum 2, late 1, vllm:nixl_num_failed_transfers_total 3"), "{}", refused.message);
    assert_eq!(plan.events.iter().map(|e| (e.reason.as_str(), e.warning)).collect::<Vec<_>>(), [("RolledBack", true)]);
}

/// After its bake, a serving pod whose counters grow makes the deployment Degraded, naming the
/// engine, role, pod and counter, with one Warning Event; the pod stays in (its gate is not
/// touched: each such handoff was refused), and when the counters held still the condition
/// clears with a Normal Event.
#[test]
fn a_serving_pod_whose_integrity_counters_grow_degrades_the_deployment_until_they_hold_still() {
    let mut d = vllm_pd();
    let mut world = World::default();
    vllm_revision(&mut world, &d, "r1");
    let plan = through_canary(&mut d, "r1", &mut world, 1_000);
    assert_eq!(phase(&plan), "Available");
    world = world_with_conditions(&world, &plan);

    // Decode's /metrics as a real pair wrote them, clean and then with counts, read as the
    // scrape reads them.
    let counters = d.spec.engine().integrity_counters(&d.spec);
    let read = |body: &str| crate::engines::integrity::read(body, counters);
    let mut watch = CounterWatch::new(read(include_str!("../../engines/testdata/vllm-metrics-2048.txt")));
    watch.read(read(include_str!("../../engines/testdata/vllm-decode-metrics-integrity.txt")), std::time::Instant::now());
    assert_eq!(watch.grown(), ["checksum 0 -> 2", "late 0 -> 1", "vllm:nixl_num_failed_transfers_total 0 -> 3"]);
    world.integrity_violations = BTreeMap::from([("llm-decode-r1-0".to_string(), watch.grown())]);
    let plan = pass_at(&mut d, "r1", &world, 1_100);
    assert_eq!((phase(&plan), plan.status.reason.as_deref()), ("Degraded", Some("HandoffMismatchesCounted")));
    let c = plan.status.conditions.iter().find(|c| c.type_ == conditions::DEGRADED).unwrap();
    let found = "vllm decode pod llm-decode-r1-0: checksum 0 -> 2, late 0 -> 1, vllm:nixl_num_failed_transfers_total 0 -> 3";
    assert_eq!(c.message, format!("serving revision r1: handoffs that did not verify: {found}"));
    assert!(plan.pod_gates.is_empty(), "no pod leaves the Service: {:?}", plan.pod_gates);
    assert_eq!(plan.status.current_revision.as_deref(), Some("r1"));
    let events: Vec<_> = plan.events.iter().map(|e| (e.reason.as_str(), e.warning, e.note.clone())).collect();
    let note = format!("serving revision r1: {found}; each was refused, not decoded from; Degraded until the counters hold still for 60 s");
    assert_eq!(events, [("HandoffMismatchesCounted", true, note)]);
    // Said once; more growth on the same pod is said again.
    assert!(pass_at(&mut d, "r1", &world, 1_101).events.is_empty());
    world.integrity_violations.insert("llm-decode-r1-0".into(), vec!["checksum 0 -> 3".into()]);
    assert_eq!(pass_at(&mut d, "r1", &world, 1_102).events.len(), 1);
    // A pod of no serving revision is not the deployment's concern here.
    world.integrity_violations = BTreeMap::from([("llm-decode-r9-0".to_string(), vec!["checksum 0 -> 1".to_string()])]);
    let plan = pass_at(&mut d, "r1", &world, 1_200);
    assert_eq!((phase(&plan), condition(&plan, conditions::DEGRADED)), ("Available", (false, "ServingPodsVerified".into())));
    assert_eq!(plan.events.iter().map(|e| (e.reason.as_str(), e.warning)).collect::<Vec<_>>(), [("HandoffCountersQuiet", false)]);
}

/// A candidate its canary refused for counted mismatches never served: Refused, not RolledBack.
#[test]
fn a_canary_refusal_on_the_counters_is_refused_not_rolled_back() {
    let (mut d, mut world) = serving_r1();
    revision(&mut world, &d, "r2", Ok(report(8192, "l")), true);
    d.spec.rollout.canary.prompts = 2;
    world.canary = Some(CanaryStatus {
        revision: "r2".into(),
        passed: false,
        message: "no integrity counter moved: decode pod llm-decode-r2-0 checksum 0 -> 1".into(),
        reason: Some(RefusalReason::HandoffIntegrityViolation),
    });
    let plan = pass(&mut d, "r2", &world);
    let refused = plan.status.refused_revision.clone().expect("refused");
    assert_eq!((refused.reason, refused.rolled_back, phase(&plan)), (RefusalReason::HandoffIntegrityViolation, false, "Refused"));
}

#[test]
fn a_pod_missing_the_deployments_own_handoff_secret_gets_it_created_again() {
    let (mut d, mut world) = serving_r1();
    let secret = crate::render::secret::secret_name(&d);
    let stuck = |message: String| crate::reconcile::pod_problems::StuckPod {
        pod: "p".into(),
        revision: Some("r1".into()),
        reason: "CreateContainerConfigError".into(),
        message,
    };
    world.stuck = vec![stuck(format!("container worker: secret \"{secret}\" not found"))];
    assert!(pass(&mut d.clone(), "r1", &world).recreate_secret);
    // Another Secret (the user's, say) is not the operator's to create.
    world.stuck = vec![stuck("container worker: secret \"someone-elses\" not found".into())];
    assert!(!pass(&mut d.clone(), "r1", &world).recreate_secret);
    world.stuck.clear();
    assert!(!pass(&mut d, "r1", &world).recreate_secret);
}

#[test]
fn the_inference_pool_condition_says_what_the_last_sync_found_and_a_change_is_announced_once() {
    use crate::reasons::Reason;
    use crate::reconcile::inference_pool::{CONDITION, PoolCondition};
    let (mut d, mut world) = serving_r1();
    let pool = |ok: bool, reason: Reason| Some(Some(PoolCondition { ok, reason, message: format!("{reason} message") }));
    let announced = |plan: &Plan| {
        plan.events.iter().filter(|e| e.action == crate::reasons::EventAction::InferencePool).map(|e| (e.warning, e.reason.as_str())).collect::<Vec<_>>()
    };

    world.inference_pool = pool(false, Reason::CrdNotInstalled);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!((condition(&plan, CONDITION), announced(&plan)), ((false, "CRDNotInstalled".into()), vec![(true, "CRDNotInstalled")]));
    assert!(announced(&pass(&mut d, "r1", &world)).is_empty(), "the same finding again is no news");

    world.inference_pool = pool(true, Reason::Applied);
    let plan = pass(&mut d, "r1", &world);
    assert_eq!((condition(&plan, CONDITION), announced(&plan)), ((true, "Applied".into()), vec![(false, "Applied")]));

    // A restarted operator has not synced yet: the condition stands as written.
    world.inference_pool = None;
    assert_eq!(condition(&pass(&mut d, "r1", &world), CONDITION), (true, "Applied".into()));
    // No pool wanted any more: no condition.
    world.inference_pool = Some(None);
    let plan = pass(&mut d, "r1", &world);
    assert!(plan.status.conditions.iter().all(|c| c.type_ != CONDITION) && announced(&plan).is_empty());
}
