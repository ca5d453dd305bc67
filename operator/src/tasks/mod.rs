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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::channel::mpsc;
use kube::runtime::reflector::ObjectRef;

use crate::crd::InferenceDeployment;

/// Asks the controller to reconcile an InferenceDeployment soon. A trigger made `held` drops
/// what it is asked until `open`: a standby's watches keep its stores current without queueing
/// wake-ups for a controller that is not running (it reconciles everything once when it leads).
#[derive(Clone, Debug)]
pub struct Trigger {
    tx: mpsc::UnboundedSender<ObjectRef<InferenceDeployment>>,
    open: Arc<AtomicBool>,
}

impl Trigger {
    /// A trigger and the stream the controller reads (`Controller::reconcile_on`).
    pub fn new() -> (Trigger, mpsc::UnboundedReceiver<ObjectRef<InferenceDeployment>>) {
        let (trigger, rx) = Self::held();
        trigger.open();
        (trigger, rx)
    }

    /// As `new`, dropping every wake-up until `open`.
    pub fn held() -> (Trigger, mpsc::UnboundedReceiver<ObjectRef<InferenceDeployment>>) {
        let (tx, rx) = mpsc::unbounded();
        (Trigger { tx, open: Arc::new(AtomicBool::new(false)) }, rx)
    }

    /// From now on every wake-up reaches the controller.
    pub fn open(&self) {
        self.open.store(true, Ordering::Release);
    }

    pub fn reconcile(&self, owner: &ObjectRef<InferenceDeployment>) {
        if self.open.load(Ordering::Acquire) {
            // Closed only when the controller stopped: nothing left to wake.
            let _ = self.tx.unbounded_send(owner.clone());
        }
    }
}
