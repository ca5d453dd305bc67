//! The control plane itself: real kubectl, controllers that work, RBAC that bites.

use kvgate_testenv::ControlPlane;

kvgate_testenv::own_network_namespace!();

#[test]
fn kubectl_lists_namespaces_through_the_kubeconfig() {
    let cp = ControlPlane::shared();
    let out = cp.kubectl_ok(&["get", "namespaces", "-o", "name"]);
    for ns in ["namespace/default", "namespace/kube-system", "namespace/kube-public"] {
        assert!(out.contains(ns), "{out}");
    }
}

#[test]
fn the_controller_manager_turns_a_deployment_into_pods() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("deploy");
    cp.kubectl_ok(&["-n", &ns, "create", "deployment", "web", "--image=kvgate/worker:test", "--replicas=2"]);
    let mut pods = String::new();
    for _ in 0..100 {
        pods = cp.kubectl_ok(&["-n", &ns, "get", "pods", "-l", "app=web", "-o", "name"]);
        if pods.lines().count() == 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(pods.lines().count(), 2, "{pods}\n{}", cp.logs());
    let rs = cp.kubectl_ok(&["-n", &ns, "get", "replicasets", "-o", "name"]);
    assert_eq!(rs.lines().count(), 1, "{rs}");
    // Garbage collection follows owner references.
    cp.kubectl_ok(&["-n", &ns, "delete", "deployment", "web", "--wait=false"]);
    for _ in 0..150 {
        if cp.kubectl_ok(&["-n", &ns, "get", "replicasets", "-o", "name"]).trim().is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    panic!("the ReplicaSet outlived its Deployment\n{}", cp.logs());
}

#[test]
fn a_service_account_without_permissions_is_forbidden() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("rbac");
    cp.kubectl_ok(&["-n", &ns, "create", "serviceaccount", "nobody"]);
    // TokenRequest: a real, signed service-account token.
    let token = cp.kubectl_ok(&["-n", &ns, "create", "token", "nobody"]);
    let out = cp.kubectl_as(token.trim(), &["-n", &ns, "get", "pods"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "listing pods without a Role must fail");
    assert!(stderr.contains("Forbidden") && stderr.contains("system:serviceaccount:"), "{stderr}");
    // Granting the permission makes the same token work.
    cp.kubectl_ok(&["-n", &ns, "create", "role", "pod-reader", "--verb=list", "--resource=pods"]);
    cp.kubectl_ok(&["-n", &ns, "create", "rolebinding", "nobody-reads", "--role=pod-reader", &format!("--serviceaccount={ns}:nobody")]);
    let out = cp.kubectl_as(token.trim(), &["-n", &ns, "get", "pods"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
