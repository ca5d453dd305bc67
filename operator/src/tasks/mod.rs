//! Work a reconcile must not wait for, run in the background: reading pods' capacity reports
//! (`probes`), scraping the KV pods' integrity counters (`scrapes`; fast during promotions and
//! bakes, slower while a revision serves), the integrity canary (`canaries`), and the probes on
//! serving pods (`serving_probes`). A reconcile reads their latest results and asks for more; each
//! task wakes the reconcile of its InferenceDeployment (`Trigger`) when it has something new, so
//! no reconcile pass ever blocks on a pod.

pub mod canaries;
pub(crate) mod counter_watch;
pub mod probes;
pub mod scrapes;
pub mod serving_probes;

use futures::channel::mpsc;
use kube::runtime::reflector::ObjectRef;

use crate::crd::InferenceDeployment;

/// Asks the controller to reconcile an InferenceDeployment soon.
#[derive(Clone, Debug)]
pub struct Trigger(mpsc::UnboundedSender<ObjectRef<InferenceDeployment>>);

impl Trigger {
    /// A trigger and the stream the controller reads (`Controller::reconcile_on`).
    pub fn new() -> (Trigger, mpsc::UnboundedReceiver<ObjectRef<InferenceDeployment>>) {
        let (tx, rx) = mpsc::unbounded();
        (Trigger(tx), rx)
    }

    pub fn reconcile(&self, owner: &ObjectRef<InferenceDeployment>) {
        // Closed only when the controller stopped: nothing left to wake.
        let _ = self.0.unbounded_send(owner.clone());
    }
}
