//! The digest of each watched object's owned fields (`owned::observed`), kept beside the
//! reflector stores rather than in the cached objects: as an annotation it gave every Service,
//! ServiceAccount, Role and RoleBinding a map of its own (a B-tree leaf, ~550 bytes) to hold
//! eight bytes. Keyed by uid, which no two objects of any kind share and a re-created object
//! never reuses; entries go with a Delete event, and a relist drops those of objects it no
//! longer lists (deleted while the watch was away).

use std::collections::HashMap;
use std::sync::Mutex;

use kube::Resource;
use kube::runtime::watcher::Event;

use super::cached::{self, Cached};
use super::owned;
use crate::labels::MANAGER;

#[derive(Default)]
pub struct Digests {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_uid: HashMap<String, Seen>,
    /// Per kind, the relists so far: an entry a kind's latest relist did not refresh is stale.
    relists: HashMap<&'static str, u32>,
}

struct Seen {
    digest: u64,
    kind: &'static str,
    relist: u32,
}

impl Digests {
    /// Records what `event` tells of the digests of `K`, and trims its objects for the cache.
    pub fn observe<K: Cached<DynamicType = ()>>(&self, event: &mut Event<K>) {
        if !K::APPLIED {
            return event_objects(event).for_each(cached::compact);
        }
        let kind = std::any::type_name::<K>();
        // Serialized before the lock is taken: reconciles read the table while watches fill it.
        let applied = match event {
            Event::InitApply(o) | Event::Apply(o) => Some(serde_json::to_value(&*o).ok().and_then(|v| owned::observed(&v, MANAGER))),
            _ => None,
        };
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let relist = inner.relists.get(kind).copied().unwrap_or_default();
        match (&*event, applied) {
            (Event::Init, _) => *inner.relists.entry(kind).or_default() += 1,
            (Event::InitDone, _) => inner.by_uid.retain(|_, seen| seen.kind != kind || seen.relist == relist),
            (Event::InitApply(o) | Event::Apply(o), Some(Some(digest))) => {
                if let Some(uid) = o.meta().uid.clone() {
                    inner.by_uid.insert(uid, Seen { digest, kind, relist });
                }
            }
            // Deleted, or no longer holding any field of this operator's applies.
            (Event::InitApply(o) | Event::Apply(o) | Event::Delete(o), _) => {
                if let Some(uid) = &o.meta().uid {
                    inner.by_uid.remove(uid);
                }
            }
        }
        drop(inner);
        event_objects(event).for_each(cached::compact);
    }

    /// Whether the cached `seen` holds exactly the fields of an object the operator would apply,
    /// given as its digest (`owned::desired`): every one with the same value, and nothing else the
    /// operator owns.
    pub fn holds<K: Resource>(&self, seen: &K, desired: u64) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        seen.meta().uid.as_ref().and_then(|uid| inner.by_uid.get(uid)).is_some_and(|s| s.digest == desired)
    }
}

/// The object an event carries, if any.
fn event_objects<K>(event: &mut Event<K>) -> impl Iterator<Item = &mut K> {
    match event {
        Event::InitApply(o) | Event::Apply(o) | Event::Delete(o) => Some(o),
        Event::Init | Event::InitDone => None,
    }
    .into_iter()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Service;
    use serde_json::json;

    use super::*;
    use crate::watch::cached::tests::applied_deployment;

    fn seen(digests: &Digests, event: Event<Deployment>) -> Option<Deployment> {
        let mut event = event;
        digests.observe(&mut event);
        match event {
            Event::Apply(o) | Event::InitApply(o) | Event::Delete(o) => Some(o),
            _ => None,
        }
    }

    #[test]
    fn an_applied_object_holds_what_was_applied_and_nothing_else() {
        let digests = Digests::default();
        let (body, stored) = applied_deployment();
        let cached = seen(&digests, Event::Apply(stored)).unwrap();
        assert!(cached.metadata.managed_fields.is_none(), "trimmed for the cache");
        assert!(digests.holds(&cached, owned::desired(&body)));
        let mut other = body.clone();
        other["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["y"]);
        assert!(!digests.holds(&cached, owned::desired(&other)));
    }

    #[test]
    fn a_deleted_or_re_created_object_holds_nothing_of_its_predecessor() {
        let digests = Digests::default();
        let (body, stored) = applied_deployment();
        let cached = seen(&digests, Event::Apply(stored.clone())).unwrap();
        seen(&digests, Event::Delete(stored.clone()));
        assert!(!digests.holds(&cached, owned::desired(&body)));

        // Same name and fields, new uid: only what the watch saw of the new object counts.
        seen(&digests, Event::Apply(stored.clone()));
        let mut again = cached.clone();
        again.metadata.uid = Some("u-2".into());
        assert!(!digests.holds(&again, owned::desired(&body)));
    }

    #[test]
    fn a_relist_drops_the_digests_of_objects_it_no_longer_lists() {
        let digests = Digests::default();
        let (body, stored) = applied_deployment();
        let mut other = stored.clone();
        other.metadata.uid = Some("u-2".into());
        seen(&digests, Event::Apply(stored.clone()));
        seen(&digests, Event::Apply(other.clone()));
        // A Service's digest is another kind's: its relists do not touch it, nor this one it.
        let mut svc: Event<Service> = Event::Apply(
            serde_json::from_value(json!({ "metadata": { "name": "s", "uid": "u-3", "labels": { "x": "y" }, "managedFields": [{ "manager": MANAGER,
                "operation": "Apply", "apiVersion": "v1", "fieldsType": "FieldsV1", "fieldsV1": { "f:metadata": { "f:labels": { "f:x": {} } } } }] } }))
            .unwrap(),
        );
        digests.observe(&mut svc);

        // The watch was away while `other` was deleted: the relist lists `stored` only.
        seen(&digests, Event::Init);
        let kept = seen(&digests, Event::InitApply(stored)).unwrap();
        seen(&digests, Event::InitDone);
        assert!(digests.holds(&kept, owned::desired(&body)));
        let inner = digests.inner.lock().unwrap();
        assert!(!inner.by_uid.contains_key("u-2"));
        assert!(inner.by_uid.contains_key("u-3"), "another kind's relist");
    }

    #[test]
    fn an_object_no_apply_of_the_operator_wrote_holds_nothing() {
        let digests = Digests::default();
        let mut event: Event<Service> = Event::Apply(serde_json::from_value(json!({ "metadata": { "name": "s", "uid": "u-9" } })).unwrap());
        digests.observe(&mut event);
        let Event::Apply(svc) = event else { unreachable!() };
        assert!(!digests.holds(&svc, owned::desired(&json!({ "metadata": { "name": "s" } }))));
    }
}
