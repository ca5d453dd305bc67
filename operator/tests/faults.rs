//! The operator dies where it hurts most: SIGKILL (no Lease released, nothing flushed) in the
//! middle of an integrity canary and in the middle of a bake, and the leader of two replicas
//! killed mid-bake. Whatever takes over finishes the rollout from what status recorded: no
//! second promotion, no second rollback, no refusal lost. Each test runs its own operators on
//! its own Lease, watching only its namespace.

mod support;

use std::time::Duration;

use kvgate_testenv::ControlPlane;
use support::*;

const LONG: Duration = Duration::from_secs(180);

/// A deployment whose canary takes seconds: sixteen prompts up to nearly the whole window.
/// A canary long enough to be caught running by a poll every 300 ms: the tiny model prefills
/// 16 prompts of up to 2000 tokens in well under a second, so each also generates 256 tokens
/// (the most the CRD allows), one at a time.
fn slow_canary(name: &str) -> String {
    format!("{}  rollout: {{ canary: {{ prompts: 16, maxPromptTokens: 1792, maxTokens: 256 }}, bakeSeconds: 0 }}\n", tiny(name, 2048, 8192, 8192, ""))
}

fn phase(cp: &ControlPlane, ns: &str, name: &str) -> String {
    infd(cp, ns, name)["status"]["phase"].as_str().unwrap_or_default().to_string()
}

#[test]
fn an_operator_killed_mid_canary_resumes_without_a_second_promotion_or_a_lost_refusal() {
    let cp = cluster();
    let ns = cp.restricted_namespace("kill-canary");
    let mut first = Operator::start_in(cp, "operator-kill-canary-1", "lease-kill-canary", Some(&ns));
    apply_yaml(cp, &ns, &slow_canary("llm"));
    eventually(cp, &ns, "the first revision's canary running", LONG, || phase(cp, &ns, "llm") == "Canary");
    first.proc.kill();
    // The Lease was not released: the next operator waits for it to expire, then resumes.
    let second = Operator::start_in(cp, "operator-kill-canary-2", "lease-kill-canary", Some(&ns));
    eventually(cp, &ns, "Available under the second operator", LONG, || phase(cp, &ns, "llm") == "Available");
    assert_eq!(events(cp, &ns, "RolloutVerified"), 1, "promoted more than once");
    let serving = infd(cp, &ns, "llm")["status"]["currentRevision"].as_str().unwrap().to_string();
    let workers = get_json(cp, &["-n", &ns, "get", "deployments", "-l", "kvgate.dev/revision"]);
    assert_eq!(workers["items"].as_array().unwrap().len(), 2, "one revision's prefill and decode: {workers}");

    // Now a candidate whose canary must fail, and the operator killed while it runs.
    let faulty = with_image(&slow_canary("llm"), &kvgate_testenv::images::faulty_worker("wrong-layout"));
    apply_yaml(cp, &ns, &faulty);
    eventually(cp, &ns, "the faulty candidate's canary running", LONG, || phase(cp, &ns, "llm") == "Canary");
    let mut second = second;
    second.proc.kill();
    let _third = Operator::start_in(cp, "operator-kill-canary-3", "lease-kill-canary", Some(&ns));
    eventually(cp, &ns, "the candidate refused under the third operator", LONG, || phase(cp, &ns, "llm") == "Refused");
    let d = infd(cp, &ns, "llm");
    assert_eq!(d["status"]["refusedRevision"]["reason"], "CanaryFailed", "{d}");
    assert_eq!(d["status"]["currentRevision"], serving.as_str(), "the serving revision never stopped serving: {d}");
    eventually(cp, &ns, "the RolloutRefused Event", Duration::from_secs(30), || events(cp, &ns, "RolloutRefused") >= 1);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(events(cp, &ns, "RolloutRefused"), 1, "refused more than once");
    assert_eq!(events(cp, &ns, "RolloutVerified"), 1);
}

/// A revision that corrupts pages after its 100th handoff is promoted and baking when the
/// operator is killed; the next one reads the bake from status, watches the counters and rolls
/// back once. A client running throughout never gets a 200 with other text.
#[test]
fn an_operator_killed_mid_bake_resumes_it_and_rolls_back_once() {
    let cp = cluster();
    let ns = cp.restricted_namespace("kill-bake");
    let mut first = Operator::start_in(cp, "operator-kill-bake-1", "lease-kill-bake", Some(&ns));
    apply_yaml(cp, &ns, &tiny("bake", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || phase(cp, &ns, "bake") == "Available");
    let good = infd(cp, &ns, "bake")["status"]["currentRevision"].as_str().unwrap().to_string();
    let router = router_endpoints(cp, &ns, "bake").pop().expect("a ready router");
    let prompt = "Every answer must be the one the verified revision gives. ".repeat(2);
    let reference = completion_text(&complete(&router, &prompt, 8).unwrap().1).unwrap();

    let bad = with_image(
        &format!("{}  rollout: {{ bakeSeconds: 600 }}\n", tiny("bake", 256, 1024, 1024, "")),
        &kvgate_testenv::images::faulty_worker("corrupt-after-100"),
    );
    apply_yaml(cp, &ns, &bad);
    eventually(cp, &ns, "the new revision promoted and baking", LONG, || phase(cp, &ns, "bake") == "Baking");
    first.proc.kill();
    // Traffic drives the bad revision past its 20th handoff while no operator runs.
    let traffic = Traffic::start(&ns, "bake", &prompt, 4);
    let _second = Operator::start_in(cp, "operator-kill-bake-2", "lease-kill-bake", Some(&ns));
    eventually(cp, &ns, "RolledBack under the second operator", LONG, || phase(cp, &ns, "bake") == "RolledBack");
    let d = infd(cp, &ns, "bake");
    assert_eq!(d["status"]["currentRevision"], good.as_str(), "{d}");
    assert_eq!(d["status"]["refusedRevision"]["reason"], "HandoffIntegrityViolation", "{d}");
    std::thread::sleep(Duration::from_secs(3));
    let answers = traffic.stop().answers;
    assert_eq!(events(cp, &ns, "RolledBack"), 1, "rolled back more than once");
    assert_eq!(events(cp, &ns, "RolloutVerified"), 2, "the first revision and the bad one, each promoted once");
    let (ok, _) = never_wrong(&answers, &reference);
    assert!(ok >= 10, "nothing was served: {} answers", answers.len());
}

/// Two replicas; the leader is killed while a (clean) bake runs. The standby takes the Lease
/// once it expires and finishes the bake: the previous revision retired once, nothing rolled
/// back.
#[test]
fn with_two_replicas_the_leader_killed_mid_bake_the_other_finishes_it() {
    let cp = cluster();
    let ns = cp.restricted_namespace("ha-bake");
    let mut a = Operator::start_in(cp, "operator-ha-bake-a", "lease-ha-bake", Some(&ns));
    std::thread::sleep(Duration::from_secs(1));
    let b = Operator::start_in(cp, "operator-ha-bake-b", "lease-ha-bake", Some(&ns));
    apply_yaml(cp, &ns, &tiny("ha", 256, 1024, 1024, ""));
    eventually(cp, &ns, "Available", LONG, || phase(cp, &ns, "ha") == "Available");
    let old = infd(cp, &ns, "ha")["status"]["currentRevision"].as_str().unwrap().to_string();
    assert_eq!((a.metric("kvgate_operator_leader"), b.metric("kvgate_operator_leader")), (Some(1.0), Some(0.0)));
    // A bigger decode pool: a new revision, promoted, then baking for 20 s.
    apply_yaml(cp, &ns, &format!("{}  rollout: {{ bakeSeconds: 20 }}\n", tiny("ha", 256, 1024, 2048, "")));
    eventually(cp, &ns, "Baking", LONG, || phase(cp, &ns, "ha") == "Baking");
    a.proc.kill();
    eventually(cp, &ns, "operator b leading", Duration::from_secs(60), || b.metric("kvgate_operator_leader") == Some(1.0));
    eventually(cp, &ns, "the bake finished by b", LONG, || phase(cp, &ns, "ha") == "Available");
    assert_eq!(events(cp, &ns, "BakeComplete"), 1);
    assert_eq!(events(cp, &ns, "RolledBack"), 0);
    eventually(cp, &ns, "the previous revision retired", LONG, || {
        get_json(cp, &["-n", &ns, "get", "deployments", "-l", &format!("kvgate.dev/revision={old}")])["items"].as_array().is_some_and(|a| a.is_empty())
    });
    assert!(b.metric(r#"kvgate_operator_reconcile_total{result="success"}"#).unwrap_or(0.0) > 0.0);
}
