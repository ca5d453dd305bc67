//! Cluster DNS for the node's pods, the part CoreDNS's `kubernetes` plugin plays in a cluster:
//! `SERVICE.NAMESPACE.svc` (and `.svc.cluster.local`) resolves to a headless Service's endpoint
//! addresses, or to a Service's cluster IP. Pods find it through the `/etc/resolv.conf` the
//! agent writes (`resolv_conf`): the pods' gateway, which the agent answers on port 53 of its
//! own (the node's) network namespace. Engines' routers reach their peers by these names
//! (`KVGATE_PREFILL_HOST`); kvgate's own router reads EndpointSlices and needs none.
//!
//! Only A questions get addresses; other types of a known name are answered with none (NODATA),
//! anything else is NXDOMAIN. There is no service proxy here: a cluster IP does not route.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use anyhow::Context;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use tokio::net::UdpSocket;

/// How long a resolver may keep an answer (CoreDNS's default).
const TTL_SECS: u32 = 5;
const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;

/// The pod's `/etc/resolv.conf`: the node's DNS at the pods' gateway, searching the pod's own
/// namespace first, as a kubelet writes it for `dnsPolicy: ClusterFirst`.
pub fn resolv_conf(namespace: &str, gateway: Ipv4Addr) -> String {
    format!("search {namespace}.svc.cluster.local svc.cluster.local cluster.local\nnameserver {gateway}\noptions ndots:5\n")
}

/// Answers DNS questions on UDP `addr` until the process ends.
pub async fn serve(client: kube::Client, addr: SocketAddr) -> anyhow::Result<()> {
    let socket = Arc::new(UdpSocket::bind(addr).await.with_context(|| format!("binding the pods' DNS to udp {addr}"))?);
    let mut buf = [0u8; 512];
    loop {
        let (n, peer) = socket.recv_from(&mut buf).await?;
        let Some(question) = Question::parse(&buf[..n]) else { continue };
        let (socket, client) = (socket.clone(), client.clone());
        tokio::spawn(async move {
            let (rcode, addresses) = match lookup(&client, &question.name).await {
                Ok(Some(addresses)) if question.qtype == TYPE_A => (0, addresses),
                Ok(Some(_)) => (0, Vec::new()),
                Ok(None) => (NXDOMAIN, Vec::new()),
                Err(e) => {
                    tracing::warn!(name = question.name, error = %e, "DNS lookup failed");
                    (SERVFAIL, Vec::new())
                }
            };
            let _ = socket.send_to(&question.reply(rcode, &addresses), peer).await;
        });
    }
}

const NXDOMAIN: u8 = 3;
const SERVFAIL: u8 = 2;

/// The Service a name asks for: `(service, namespace)`.
fn service_of(name: &str) -> Option<(&str, &str)> {
    let name = name.trim_end_matches('.');
    let name = name.strip_suffix(".cluster.local").unwrap_or(name);
    let (service, namespace) = name.strip_suffix(".svc")?.split_once('.')?;
    (!service.is_empty() && !namespace.is_empty() && !namespace.contains('.')).then_some((service, namespace))
}

/// The addresses of the Service `name` names; `None` when there is no such Service.
async fn lookup(client: &kube::Client, name: &str) -> Result<Option<Vec<Ipv4Addr>>, kube::Error> {
    let Some((service, namespace)) = service_of(name) else { return Ok(None) };
    let Some(svc) = Api::<Service>::namespaced(client.clone(), namespace).get_opt(service).await? else { return Ok(None) };
    let cluster_ip = svc.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
    if cluster_ip != "None" {
        return Ok(Some(cluster_ip.parse().into_iter().collect()));
    }
    // Headless: its endpoints, ready ones (the slice controller marks not-ready ones ready
    // where the Service publishes them).
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
        .await?;
    let addresses = slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .flat_map(|e| e.addresses.iter())
        .filter_map(|a| a.parse().ok())
        .collect();
    Ok(Some(addresses))
}

/// The one question of a query, and where it ends in the message.
#[derive(Debug, PartialEq)]
struct Question {
    id: u16,
    recursion_desired: bool,
    name: String,
    qtype: u16,
    /// The question section as asked (name, type and class), repeated in the reply.
    raw: Vec<u8>,
}

impl Question {
    /// A standard query with one question of class IN; anything else is dropped.
    fn parse(msg: &[u8]) -> Option<Question> {
        let header = msg.get(..12)?;
        let flags = u16::from_be_bytes([header[2], header[3]]);
        let (is_response, opcode, questions) = (flags & 0x8000 != 0, (flags >> 11) & 0xf, u16::from_be_bytes([header[4], header[5]]));
        if is_response || opcode != 0 || questions != 1 {
            return None;
        }
        let mut labels = Vec::new();
        let mut at = 12;
        loop {
            let len = usize::from(*msg.get(at)?);
            at += 1;
            if len == 0 {
                break;
            }
            // Compression pointers (0xc0) do not occur in a question asked first.
            if len > 63 {
                return None;
            }
            labels.push(std::str::from_utf8(msg.get(at..at + len)?).ok()?.to_ascii_lowercase());
            at += len;
        }
        let fixed = msg.get(at..at + 4)?;
        let (qtype, class) = (u16::from_be_bytes([fixed[0], fixed[1]]), u16::from_be_bytes([fixed[2], fixed[3]]));
        (class == CLASS_IN).then(|| Question {
            id: u16::from_be_bytes([header[0], header[1]]),
            recursion_desired: flags & 0x0100 != 0,
            name: labels.join("."),
            qtype,
            raw: msg[12..at + 4].to_vec(),
        })
    }

    /// An authoritative answer: `rcode`, and one A record per address.
    fn reply(&self, rcode: u8, addresses: &[Ipv4Addr]) -> Vec<u8> {
        let flags: u16 = 0x8000 | 0x0400 | if self.recursion_desired { 0x0100 } else { 0 } | 0x0080 | u16::from(rcode);
        let answers = u16::try_from(addresses.len()).unwrap_or(u16::MAX).min(30);
        let mut out = Vec::with_capacity(12 + self.raw.len() + 16 * usize::from(answers));
        for word in [self.id, flags, 1, answers, 0, 0] {
            out.extend(word.to_be_bytes());
        }
        out.extend(&self.raw);
        for a in addresses.iter().take(answers.into()) {
            // The name is a pointer to the question's (offset 12).
            out.extend([0xc0, 12]);
            out.extend(TYPE_A.to_be_bytes());
            out.extend(CLASS_IN.to_be_bytes());
            out.extend(TTL_SECS.to_be_bytes());
            out.extend(4u16.to_be_bytes());
            out.extend(a.octets());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query as glibc sends it: id, RD, one question.
    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend(label.as_bytes());
        }
        q.push(0);
        q.extend(qtype.to_be_bytes());
        q.extend(CLASS_IN.to_be_bytes());
        q
    }

    #[test]
    fn names_of_services_in_a_namespace_and_nothing_else() {
        assert_eq!(service_of("holds-prefill-abc.vllm-pd.svc"), Some(("holds-prefill-abc", "vllm-pd")));
        assert_eq!(service_of("holds-prefill-abc.vllm-pd.svc.cluster.local."), Some(("holds-prefill-abc", "vllm-pd")));
        // What ndots:5 tries first, through the search list, is no Service.
        assert_eq!(service_of("holds-prefill-abc.vllm-pd.svc.vllm-pd.svc.cluster.local"), None);
        assert_eq!(service_of("holds-prefill-abc.vllm-pd.svc.svc.cluster.local"), None);
        assert_eq!(service_of("example.com"), None);
        assert_eq!(service_of("vllm-pd.svc"), None);
    }

    #[test]
    fn a_question_is_answered_with_its_id_its_question_and_one_record_per_address() {
        let q = Question::parse(&query("Holds.NS.svc", TYPE_A)).unwrap();
        assert_eq!((q.id, q.recursion_desired, q.name.as_str(), q.qtype), (0x1234, true, "holds.ns.svc", TYPE_A));
        let reply = q.reply(0, &[Ipv4Addr::new(10, 1, 0, 7), Ipv4Addr::new(10, 1, 0, 9)]);
        let asked = query("Holds.NS.svc", TYPE_A);
        assert_eq!(&reply[..2], &[0x12, 0x34]);
        assert_eq!(u16::from_be_bytes([reply[2], reply[3]]), 0x8580, "response, authoritative, RD and RA, NOERROR");
        assert_eq!(&reply[4..12], &[0, 1, 0, 2, 0, 0, 0, 0], "one question, two answers");
        assert_eq!(&reply[12..asked.len()], &asked[12..], "the question as asked");
        let first = &reply[asked.len()..asked.len() + 16];
        assert_eq!(first, &[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 10, 1, 0, 7]);
        assert_eq!(&reply[reply.len() - 4..], &[10, 1, 0, 9]);
        let missing = q.reply(NXDOMAIN, &[]);
        assert_eq!((missing[3] & 0xf, &missing[6..8]), (NXDOMAIN, &[0u8, 0][..]));
    }

    #[test]
    fn responses_other_opcodes_and_truncated_messages_are_dropped() {
        let mut response = query("a.b.svc", TYPE_A);
        response[2] |= 0x80;
        assert_eq!(Question::parse(&response), None);
        let mut update = query("a.b.svc", TYPE_A);
        update[2] |= 5 << 3;
        assert_eq!(Question::parse(&update), None);
        let whole = query("a.b.svc", TYPE_A);
        assert_eq!(Question::parse(&whole[..whole.len() - 1]), None);
        assert_eq!(Question::parse(&whole[..5]), None);
    }
}
