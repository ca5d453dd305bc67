//! Server-side apply of owned objects, and deletion of those no longer wanted.

use k8s_openapi::NamespaceResourceScope;
use kube::Resource;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Error, MANAGER, kube_err};

/// Applies `obj` (named by its metadata) in `ns`; unchanged objects are not written.
pub async fn apply<K>(client: &kube::Client, ns: &str, obj: &K) -> Result<K, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let name = obj.meta().name.clone().unwrap_or_default();
    let mut body = serde_json::to_value(obj).expect("k8s objects serialize");
    body["apiVersion"] = K::api_version(&()).into();
    body["kind"] = K::kind(&()).into();
    api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&body)).await.map_err(kube_err(format!("applying {} {name}", K::kind(&()))))
}

pub async fn delete<K>(client: &kube::Client, ns: &str, name: &str) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + DeserializeOwned + Clone + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(kube_err(format!("deleting {} {name}", K::kind(&())))(e)),
    }
}
