//! Two machines: kube-scheduler places the operator's pods on two nodes (each node agent in a
//! network namespace of its own with its own pod bridge and CIDR, joined by the test world's
//! fabric), so every KV handoff between prefill and decode crosses from one machine to the other;
//! a node lost with a client running; the link between the nodes shaped and cut mid-handoff; a
//! partition between them while both still reach the API server.
//!
//! The tests share the two nodes and change them (one is powered off and started again, links are
//! shaped and cut), so they run one at a time.

mod support;

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvgate_testenv::ControlPlane;
use kvgate_testenv::controlplane::{NODE_HEARTBEAT_SECS, NODE_MONITOR_GRACE_SECS};
use kvgate_testenv::fabric;
use kvgate_testenv::nodes::{Node, Resources};
use serde_json::Value;
use support::*;

const LONG: Duration = Duration::from_secs(180);
/// After a rollback is seen, how long routers may still hand off to the rolled-back prefill
/// pods: their EndpointSlices' update reaching every router, and a request already under way.
const ROUTERS_FOLLOW: Duration = Duration::from_secs(5);

/// Node-2's size, unlike node-1's default, so the test can tell that each reports its own.
fn node_2_resources() -> Resources {
    Resources { cpu: "8".into(), memory: "32Gi".into(), ephemeral_storage: "50Gi".into() }
}

struct World {
    node_2: Option<Node>,
}

fn start_node_2(cp: &ControlPlane) -> Node {
    let images = kvgate_testenv::images::node_images().unwrap_or_else(|e| panic!("the kvgate images: {e:#}"));
    cp.node_agent_with(&workspace_bin("kvgate-node-agent"), "node-2", &images, &node_2_resources()).unwrap_or_else(|e| panic!("node-2: {e:#}"))
}

/// The control plane with node-1 and node-2, the operator, and the right to change them.
fn world() -> (&'static ControlPlane, &'static Operator, MutexGuard<'static, World>) {
    static OP: OnceLock<Operator> = OnceLock::new();
    static WORLD: Mutex<World> = Mutex::new(World { node_2: None });
    let cp = cluster();
    let op = OP.get_or_init(|| Operator::start(cp, "operator"));
    // A test that failed holding the lock leaves the world usable: the next one checks what it needs.
    let mut world = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    if world.node_2.is_none() {
        world.node_2 = Some(start_node_2(cp));
    }
    (cp, op, world)
}

/// `(component, node)` of every live pod of deployment `name`.
fn placement(cp: &ControlPlane, ns: &str, name: &str) -> Vec<(String, String)> {
    let pods = get_json(cp, &["-n", ns, "get", "pods", "-l", &format!("app.kubernetes.io/instance={name}")]);
    let mut out: Vec<(String, String)> = pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            let component = p["metadata"]["labels"]["app.kubernetes.io/component"].as_str().unwrap_or_default().to_string();
            (component, p["spec"]["nodeName"].as_str().unwrap_or_default().to_string())
        })
        .collect();
    out.sort();
    out
}

/// The live pods of one component, as JSON.
fn pods_of(cp: &ControlPlane, ns: &str, name: &str, component: &str) -> Vec<Value> {
    let pods = get_json(cp, &["-n", ns, "get", "pods", "-l", &format!("app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")]);
    pods["items"].as_array().into_iter().flatten().filter(|p| p["metadata"]["deletionTimestamp"].is_null()).cloned().collect()
}

/// Sum of a metric family over the pod's /metrics (dialled on its address from the world).
fn pod_metric(pod: &Value, family: &str) -> Option<f64> {
    let text = get(&format!("http://{}/metrics", pod_http(pod)?))?;
    Some(kvgate_testenv::metrics::family_sum(&text, family))
}

/// KV pages each live worker pod of the deployment holds (`None`: its /metrics did not answer).
fn pages_held(cp: &ControlPlane, ns: &str, name: &str) -> Vec<(String, Option<f64>)> {
    ["prefill", "decode"]
        .iter()
        .flat_map(|c| pods_of(cp, ns, name, c))
        .map(|p| (p["metadata"]["name"].as_str().unwrap_or_default().to_string(), pod_metric(&p, "kvgate_kv_pool_pages_in_use")))
        .collect()
}

/// Waits until every live worker pod of the deployment holds no KV page.
fn no_pages_held(cp: &ControlPlane, ns: &str, name: &str, what: &str) {
    kvgate_testenv::wait::eventually(
        &format!("every KV page free ({what})"),
        Duration::from_secs(30),
        Duration::from_millis(500),
        || pages_held(cp, ns, name).iter().all(|(_, pages)| *pages == Some(0.0)),
        || format!("pages held: {:?}\n{}", pages_held(cp, ns, name), diagnostics(cp, ns)),
    );
}

fn ready_replicas(cp: &ControlPlane, ns: &str, name: &str, role: &str) -> i64 {
    infd(cp, ns, name)["status"][role]["readyReplicas"].as_i64().unwrap_or(0)
}

/// A tiny deployment with `replicas` prefill and decode workers each.
fn deployment(name: &str, replicas: u32) -> String {
    tiny(name, 2048, 4096, 4096, "").replace("replicas: 1", &format!("replicas: {replicas}"))
}

/// `yaml` (as `tiny` writes it) with `role`'s pods pinned to `node`.
fn pinned(yaml: &str, role: &str, node: &str) -> String {
    let selector = format!("nodeSelector: {{ kubernetes.io/hostname: {node} }}");
    match role {
        "router" => format!("{yaml}  router: {{ {selector} }}\n"),
        worker => {
            let block = format!("  {worker}:\n");
            assert!(yaml.contains(&block), "no {worker} block in {yaml}");
            yaml.replacen(&block, &format!("{block}    {selector}\n"), 1)
        }
    }
}

/// How many failed answers carried each error code.
fn codes(answers: &[(u16, String)]) -> std::collections::BTreeMap<String, usize> {
    let mut codes = std::collections::BTreeMap::new();
    for (_, body) in answers.iter().filter(|(s, _)| *s != 200) {
        *codes.entry(error_code(body).unwrap_or_else(|| "(none)".into())).or_default() += 1;
    }
    codes
}

#[test]
fn both_nodes_are_ready_and_prefill_and_decode_land_on_different_machines() {
    let (cp, _op, _world) = world();
    let nodes = get_json(cp, &["get", "nodes"]);
    let mut seen: Vec<(String, String, String, String)> = nodes["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let ready = n["status"]["conditions"].as_array().into_iter().flatten().find(|c| c["type"] == "Ready").map(|c| c["status"].clone());
            assert_eq!(ready, Some("True".into()), "{n}");
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (s(&n["metadata"]["name"]), s(&n["status"]["allocatable"]["cpu"]), s(&n["status"]["allocatable"]["memory"]), s(&n["spec"]["podCIDR"]))
        })
        .collect();
    seen.sort();
    let (cidr_1, cidr_2) = (fabric::pod_cidr(1), fabric::pod_cidr(2));
    assert_eq!(seen, vec![("node-1".into(), "16".into(), "64Gi".into(), cidr_1.clone()), ("node-2".into(), "8".into(), "32Gi".into(), cidr_2.clone())]);

    // The default spread, each role across nodes: one prefill and one decode per node; the
    // router pinned by the spec.
    let ns = cp.restricted_namespace("spread");
    apply_yaml(cp, &ns, &pinned(&deployment("spread", 2), "router", "node-2"));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "spread")["status"]["phase"] == "Available");
    let want: Vec<(String, String)> = [("decode", "node-1"), ("decode", "node-2"), ("prefill", "node-1"), ("prefill", "node-2"), ("router", "node-2")]
        .map(|(c, n)| (c.into(), n.into()))
        .into();
    assert_eq!(placement(cp, &ns, "spread"), want);
    for component in ["prefill", "decode"] {
        for pod in pods_of(cp, &ns, "spread", component) {
            let (node, ip) = (pod["spec"]["nodeName"].as_str().unwrap(), pod["status"]["podIP"].as_str().unwrap());
            let prefix = if node == "node-1" { &cidr_1 } else { &cidr_2 };
            assert!(ip.starts_with(prefix.trim_end_matches("0/24")), "{component} on {node} has {ip}, outside {prefix}");
            assert_eq!(pod["status"]["hostIP"].as_str(), Some(if node == "node-1" { "198.19.0.11" } else { "198.19.0.12" }));
        }
    }
    // Handoffs cross machines (the router picks its pair per request): every answer the same.
    let router = router_endpoints(cp, &ns, "spread").pop().unwrap();
    let answers: Vec<(u16, String)> = (0..6).map(|_| complete(&router, "Hello", 6).expect("the router answers")).collect();
    let reference = completion_text(&answers[0].1).unwrap_or_else(|| panic!("{:?}", answers[0]));
    assert_eq!(never_wrong(&answers, &reference), (6, 0));

    // Decode pinned to a node that does not exist: the scheduler's own reason, in status.
    apply_yaml(cp, &ns, &pinned(&deployment("nowhere", 1), "decode", "node-9"));
    let mut message = String::new();
    eventually(cp, &ns, "Progressing names the unschedulable decode pod", LONG, || {
        let d = infd(cp, &ns, "nowhere");
        let c = condition(&d, "Progressing").cloned().unwrap_or_default();
        message = c["message"].as_str().unwrap_or_default().to_string();
        c["reason"] == "PodsCannotStart"
    });
    assert!(message.contains("nowhere-decode-") && message.contains("Unschedulable: 0/2 nodes are available"), "{message}");
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn a_node_lost_with_a_client_running_loses_no_request_and_serving_recovers_on_the_other() {
    let (cp, _op, mut world) = world();
    let ns = cp.restricted_namespace("nodeloss");
    apply_yaml(cp, &ns, &pinned(&deployment("loss", 2), "router", "node-1"));
    let spread: Vec<(String, String)> = [("decode", "node-1"), ("decode", "node-2"), ("prefill", "node-1"), ("prefill", "node-2"), ("router", "node-1")]
        .map(|(c, n)| (c.into(), n.into()))
        .into();
    eventually(cp, &ns, "Available with a prefill and a decode on each node", LONG, || {
        infd(cp, &ns, "loss")["status"]["phase"] == "Available" && placement(cp, &ns, "loss") == spread
    });
    let router = router_endpoints(cp, &ns, "loss").pop().unwrap();
    let (status, body) = complete(&router, "Hello", 8).unwrap();
    assert_eq!(status, 200, "{body}");
    let reference = completion_text(&body).unwrap();

    let traffic = Traffic::start(&ns, "loss", "Hello", 1);
    std::thread::sleep(Duration::from_secs(2));
    let killed = Instant::now();
    world.node_2.take().unwrap().power_off();

    let mut marks = Vec::new();
    let mut mark = |what: &str| marks.push((what.to_string(), killed.elapsed()));
    eventually(cp, &ns, "node-2 NotReady", Duration::from_secs(NODE_MONITOR_GRACE_SECS + 30), || cp.node_ready("node-2") == Some(false));
    mark("node-2 NotReady");
    eventually(cp, &ns, "node-2's pods evicted", Duration::from_secs(90), || {
        let pods = get_json(cp, &["-n", &ns, "get", "pods", "--field-selector=spec.nodeName=node-2"]);
        pods["items"].as_array().is_some_and(|a| !a.is_empty() && a.iter().all(|p| !p["metadata"]["deletionTimestamp"].is_null()))
    });
    mark("its pods evicted");
    eventually(cp, &ns, "two verified prefill and decode workers again, on node-1", LONG, || {
        ready_replicas(cp, &ns, "loss", "prefill") == 2
            && ready_replicas(cp, &ns, "loss", "decode") == 2
            && placement(cp, &ns, "loss").iter().all(|(_, n)| n == "node-1")
            && pods_of(cp, &ns, "loss", "decode").len() == 2
    });
    mark("replacements verified and serving");
    // Serving holds once recovered.
    std::thread::sleep(Duration::from_secs(5));
    let attempts = traffic.stop_timed();

    let unreachable = attempts.iter().filter(|(_, a)| a.is_none()).count();
    assert_eq!(unreachable, 0, "the router (on node-1) stopped answering");
    let answers: Vec<(u16, String)> = attempts.iter().filter_map(|(_, a)| a.clone()).collect();
    let (served, failed) = never_wrong(&answers, &reference);
    let codes = codes(&answers);
    let failures: Vec<String> = attempts
        .iter()
        .filter_map(|(sent, a)| a.as_ref().filter(|(s, _)| *s != 200).map(|(s, body)| (sent, s, body)))
        .map(|(sent, s, body)| format!("{} ms after the kill: {s} {body}", sent.saturating_duration_since(killed).as_millis()))
        .collect();
    // Nothing lost: a request whose peer died before any byte reached the client is tried
    // again on the survivors (worker/src/roles/retry.rs), so every one is served.
    assert_eq!(failed, 0, "requests failed through the node loss ({marks:?}):\n{}", failures.join("\n"));
    eprintln!(
        "node loss (heartbeat {NODE_HEARTBEAT_SECS} s, grace {NODE_MONITOR_GRACE_SECS} s, eviction after 30 s): {} requests, {served} served with the reference text, {failed} failed {codes:?}; {}",
        answers.len(),
        marks.iter().map(|(w, t)| format!("{w} at {:.1} s", t.as_secs_f64())).collect::<Vec<_>>().join(", ")
    );
    no_pages_held(cp, &ns, "loss", "the survivors");

    // The machine comes back: Ready again, and its agent finishes the pods evicted while it was
    // gone (they were still bound to it, Terminating).
    world.node_2 = Some(start_node_2(cp));
    eventually(cp, &ns, "node-2's old pods gone", Duration::from_secs(60), || {
        get_json(cp, &["-n", &ns, "get", "pods", "--field-selector=spec.nodeName=node-2"])["items"].as_array().is_some_and(|a| a.is_empty())
    });
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}

#[test]
fn the_kv_link_between_machines_shaped_cut_and_partitioned_never_answers_wrong() {
    let (cp, _op, world) = world();
    let node_2 = world.node_2.as_ref().unwrap();
    let node_1 = node_1();
    let ns = cp.restricted_namespace("partition");
    // Prefill on node-1, decode on node-2: every handoff crosses the link between them.
    let yaml = format!(
        "{}  handoff: {{ timeoutMs: 3000 }}\n",
        pinned(&pinned(&pinned(&deployment("split", 1), "prefill", "node-1"), "decode", "node-2"), "router", "node-1")
    );
    apply_yaml(cp, &ns, &yaml);
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "split")["status"]["phase"] == "Available");
    let want: Vec<(String, String)> = [("decode", "node-2"), ("prefill", "node-1"), ("router", "node-1")].map(|(c, n)| (c.into(), n.into())).into();
    assert_eq!(placement(cp, &ns, "split"), want);
    let router = router_endpoints(cp, &ns, "split").pop().unwrap();
    let long_prompt: &'static str = "the quick brown fox jumps over the lazy dog ".repeat(30).leak();
    let reference = |prompt: &str| {
        let (status, body) = complete(&router, prompt, 2).unwrap();
        assert_eq!(status, 200, "{body}");
        completion_text(&body).unwrap()
    };
    let (short_ref, long_ref) = (reference("Hello"), reference(long_prompt));
    let decode = pods_of(cp, &ns, "split", "decode").pop().unwrap();
    let counted = || {
        pod_metric(&decode, "kvgate_handoff_reservations_expired_total").unwrap_or(0.0) + pod_metric(&decode, "kvgate_handoff_mismatch_total").unwrap_or(0.0)
    };

    // 1. A slow link into decode's machine: the handoff takes longer and is served whole.
    node_2.machine.shape(4000, 32).unwrap();
    let (status, body) = complete(&router, long_prompt, 2).unwrap();
    assert_eq!((status, completion_text(&body)), (200, Some(long_ref.clone())), "{body}");
    assert_eq!(counted(), 0.0, "a slow but whole handoff was counted as failed");

    // 2. Slower still, and the link cut one second into the handoff (past decode's 3 s timeout),
    // then back: decode counts the cut handoff and no page stays held. The request is answered
    // whole when the router's retry (worker/src/roles/retry.rs: prefill failed, or decode
    // refused the late transfer) found the link back, or fails with decode's reason when all
    // three attempts met the cut. Never anything but the reference.
    node_2.machine.shape(256, 16).unwrap();
    let request = std::thread::spawn({
        let router = router.clone();
        move || complete(&router, long_prompt, 2)
    });
    std::thread::sleep(Duration::from_secs(1));
    fabric::partition(&node_1.machine, &node_2.machine).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    fabric::heal(&node_1.machine, &node_2.machine).unwrap();
    node_2.machine.unshape().unwrap();
    let (status, body) = request.join().unwrap().expect("an answer from the router");
    if status == 200 {
        assert_eq!(completion_text(&body), Some(long_ref.clone()), "{body}");
        let router_pod = pods_of(cp, &ns, "split", "router").pop().unwrap();
        assert!(pod_metric(&router_pod, "kvgate_router_retries_total").unwrap_or(0.0) >= 1.0, "answered whole only by a retry: {body}");
    } else {
        assert!(error_code(&body).is_some_and(|c| c.starts_with("kv_handoff")), "the client is not told what failed: {status} {body}");
    }
    eventually(cp, &ns, "decode to count the cut handoff", Duration::from_secs(15), || counted() >= 1.0);
    no_pages_held(cp, &ns, "split", "both machines");

    // 3. A partition between the machines: each still reaches the API server (Ready, pods
    // Ready), requests fail with a code and none is answered with anything but the reference.
    fabric::partition(&node_1.machine, &node_2.machine).unwrap();
    let during: Vec<(u16, String)> = (0..3).map(|_| complete(&router, "Hello", 2).expect("the router answers")).collect();
    assert_eq!(never_wrong(&during, &short_ref), (0, 3), "{during:?}");
    std::thread::sleep(Duration::from_secs(NODE_MONITOR_GRACE_SECS.max(5)));
    assert_eq!((cp.node_ready("node-1"), cp.node_ready("node-2")), (Some(true), Some(true)), "a node lost the API server in a partition between pods");
    assert_eq!(ready_replicas(cp, &ns, "split", "decode"), 1, "decode is alive and reports to the API server");
    fabric::heal(&node_1.machine, &node_2.machine).unwrap();
    no_pages_held(cp, &ns, "split", "both machines");
    let after: Vec<(u16, String)> = (0..3).map(|_| complete(&router, "Hello", 2).expect("the router answers")).collect();
    assert_eq!(never_wrong(&after, &short_ref), (3, 0), "{after:?}");
    eprintln!(
        "partition: failed with {:?}; link cut mid-handoff: {}",
        during.iter().map(|(s, b)| format!("{s} {}", error_code(b).unwrap_or_default())).collect::<Vec<_>>(),
        if status == 200 { "answered whole after a retry".to_string() } else { error_code(&body).unwrap_or_default() }
    );
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}

/// Resident memory of the running worker containers of namespace `ns` on both nodes, in MiB:
/// (sum, largest).
fn workers_rss(cp: &ControlPlane, ns: &str, world: &World) -> (u64, u64) {
    let pods = get_json(cp, &["-n", ns, "get", "pods", "-l", "app.kubernetes.io/component in (prefill,decode)"]);
    let uids: Vec<String> = pods["items"].as_array().into_iter().flatten().filter_map(|p| p["metadata"]["uid"].as_str().map(|u| format!("-{u}-"))).collect();
    let all: Vec<u64> = [node_1()]
        .into_iter()
        .chain(world.node_2.as_ref())
        .flat_map(|n| n.container_rss())
        .filter(|(id, _)| uids.iter().any(|u| id.contains(u)))
        .map(|(_, bytes)| bytes >> 20)
        .collect();
    (all.iter().sum(), all.iter().copied().max().unwrap_or(0))
}

/// Continuous load through everything an operator does to a serving deployment: a rollout (its
/// canary and a bake that promotes), a revision that goes bad under traffic (its bake rolls it
/// back), and a node lost and back. `KVGATE_CLUSTER_SOAK_ROUNDS` rounds (1 in `make test`, more in
/// `make soak`); the totals are printed.
#[test]
fn a_soak_through_rollouts_a_rollback_and_a_node_loss_never_answers_wrong() {
    let (cp, op, mut world) = world();
    let rounds: usize = std::env::var("KVGATE_CLUSTER_SOAK_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(1);
    let ns = cp.restricted_namespace("soak");
    // Two pools, alternated by each round's rollout (a new revision each time).
    let spec = |tokens: u64, rollout: &str| {
        let two = tiny("soak", 256, 1024, tokens, "").replace("replicas: 1", "replicas: 2");
        format!("{}  rollout: {{ {rollout} }}\n", pinned(&two, "router", "node-1"))
    };
    apply_yaml(cp, &ns, &spec(1024, "bakeSeconds: 3"));
    eventually(cp, &ns, "Available", LONG, || infd(cp, &ns, "soak")["status"]["phase"] == "Available");
    let prompt = "Every answer must be the one the verified revision gives. ".repeat(2);
    let (status, body) = complete(&router_endpoints(cp, &ns, "soak").pop().unwrap(), &prompt, 8).unwrap();
    assert_eq!(status, 200, "{body}");
    let reference = completion_text(&body).unwrap();
    let operator_rss = || kvgate_testenv::nodes::rss(op.proc.pid() as i64).unwrap_or(0) >> 20;
    let (operator_start, workers_start) = (operator_rss(), workers_rss(cp, &ns, &world));
    let started = Instant::now();
    let traffic = Traffic::start(&ns, "soak", &prompt, 3);
    // From applying each bad revision until its rollback is seen, and the moment routers take to
    // drop its peers after: the only time a request may be refused.
    let mut bad_windows = Vec::new();

    for round in 0..rounds {
        let tokens = if round % 2 == 0 { 2048 } else { 1024 };
        // A good rollout: canary, bake, promoted.
        let before = infd(cp, &ns, "soak")["status"]["currentRevision"].clone();
        apply_yaml(cp, &ns, &spec(tokens, "bakeSeconds: 3"));
        eventually(cp, &ns, "the rollout promoted and Available", LONG, || {
            let d = infd(cp, &ns, "soak");
            d["status"]["phase"] == "Available" && d["status"]["currentRevision"] != before
        });
        // A revision that corrupts pages after its 100th handoff: promoted, then rolled back.
        let good = infd(cp, &ns, "soak")["status"]["currentRevision"].clone();
        let bad = with_image(&spec(tokens, "bakeSeconds: 600"), &kvgate_testenv::images::faulty_worker("corrupt-after-100"));
        let bad_from = Instant::now();
        apply_yaml(cp, &ns, &bad);
        eventually(cp, &ns, "RolledBack", LONG, || infd(cp, &ns, "soak")["status"]["phase"] == "RolledBack");
        bad_windows.push(bad_from..Instant::now() + ROUTERS_FOLLOW);
        assert_eq!(infd(cp, &ns, "soak")["status"]["currentRevision"], good);
        apply_yaml(cp, &ns, &spec(tokens, "bakeSeconds: 3"));
        eventually(cp, &ns, "Available on the good revision", LONG, || infd(cp, &ns, "soak")["status"]["phase"] == "Available");
        // A node lost, its pods replaced on the survivor, the node back.
        world.node_2.take().unwrap().power_off();
        eventually(cp, &ns, "node-2 NotReady", Duration::from_secs(NODE_MONITOR_GRACE_SECS + 30), || cp.node_ready("node-2") == Some(false));
        eventually(cp, &ns, "every worker on node-1 and verified", LONG, || {
            ready_replicas(cp, &ns, "soak", "prefill") == 2
                && ready_replicas(cp, &ns, "soak", "decode") == 2
                && placement(cp, &ns, "soak").iter().all(|(_, n)| n == "node-1")
        });
        world.node_2 = Some(start_node_2(cp));
    }
    std::thread::sleep(Duration::from_secs(2));
    let attempts = traffic.stop_timed();
    let unanswered = attempts.iter().filter(|(_, a)| a.is_none()).count();
    let answers: Vec<(u16, String)> = attempts.iter().filter_map(|(_, a)| a.clone()).collect();
    let (served, failed) = never_wrong(&answers, &reference);
    let codes = codes(&answers);
    no_pages_held(cp, &ns, "soak", "the end of the soak");
    // Routers, prefill and decode pods replaced in rollouts and on the lost node leave their
    // endpoints while still accepting (their shutdown delay). What is left: a connection that
    // reaches a router in the instant it stops accepting, when this client's view of the
    // endpoints (refreshed every half second through kubectl, on a loaded machine) lagged more
    // than the delay. At most 1 in 1,000 (1 of 6,660 in one CI run).
    assert!(unanswered * 1000 <= attempts.len(), "{unanswered} of {} requests got no answer", attempts.len());
    // The only failures are the bad revision's refused handoffs before its rollback. Nothing
    // else: a peer that died, or a transfer that outlived its reservation while pods came and
    // went (decode's `timeout`), is tried again on the survivors.
    let unexpected: Vec<&String> = codes.keys().filter(|c| c.as_str() != "kv_handoff_checksum").collect();
    let bodies: Vec<&String> =
        answers.iter().filter(|(s, b)| *s != 200 && error_code(b).is_some_and(|c| unexpected.contains(&&c))).map(|(_, b)| b).take(5).collect();
    assert!(unexpected.is_empty(), "failures other than refused handoffs: {codes:?}: {bodies:?}");
    let outside: Vec<f64> = attempts
        .iter()
        .filter(|(sent, a)| a.as_ref().is_some_and(|(s, _)| *s != 200) && !bad_windows.iter().any(|w| w.contains(sent)))
        .map(|(sent, _)| sent.duration_since(started).as_secs_f64())
        .collect();
    assert!(outside.is_empty(), "refused handoffs outside a bad revision's bake (seconds into the soak): {outside:?}");
    let (operator_end, workers_end) = (operator_rss(), workers_rss(cp, &ns, &world));
    eprintln!(
        "cluster soak: {rounds} round(s) in {:.0} s: {} requests, {served} 200s all equal to the reference, {failed} non-200 {codes:?} (all during a bad revision's bake), {unanswered} unanswered; \
         pages in use at the end 0; operator RSS {operator_start} -> {operator_end} MiB; worker containers RSS (sum, largest) {workers_start:?} -> {workers_end:?} MiB",
        started.elapsed().as_secs_f64(),
        answers.len()
    );
    assert!(served >= 10, "{served} served: the load never ran");
    cp.kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}
