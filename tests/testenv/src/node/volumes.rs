//! Pod volumes on the node agent: `secret`, `configMap`, `emptyDir` and `projected` (the
//! service-account token volume the API server adds to pods) become directories under the pod's
//! directory, `hostPath` is used as is, a `persistentVolumeClaim` is the directory of the
//! PersistentVolume it is bound to (a `hostPath` or `local` one: what a node can mount without a
//! storage driver; an unbound claim waits, as on a node), and each container sees them at their
//! `mountPath` through its own mount namespace (bind mounts, read-only where asked), as a real
//! container would. A pod's `fsGroup` owns its secret, configMap and projected files and may read
//! them, as the kubelet arranges. Secret volumes are kept up to date while the pod runs
//! ([`refresh_secrets`]), each file replaced whole (written aside, then renamed over the old one),
//! as the kubelet updates a mounted Secret.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{ConfigMap, Container, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::Api;

use super::bundle::Mount;

/// Materializes the pod's volumes; a name -> directory map, or why a volume cannot be had.
pub async fn prepare(client: &kube::Client, pod: &Pod, dir: &Path, token: Option<&str>) -> Result<BTreeMap<String, PathBuf>, String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let mut out = BTreeMap::new();
    let fs_group = pod.spec.as_ref().and_then(|s| s.security_context.as_ref()).and_then(|c| c.fs_group).and_then(|g| u32::try_from(g).ok());
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let path = dir.join("volumes").join(&v.name);
        let files: Option<(BTreeMap<String, Vec<u8>>, i32)> = if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let secret = Api::<Secret>::namespaced(client.clone(), ns).get(&name).await.map_err(|e| format!("volume {}: secret {name}: {e}", v.name))?;
            let data = secret.data.unwrap_or_default().into_iter().map(|(k, b)| (k, b.0)).collect();
            Some((data, s.default_mode.unwrap_or(0o644)))
        } else if let Some(c) = &v.config_map {
            let name = c.name.clone();
            let cm = Api::<ConfigMap>::namespaced(client.clone(), ns).get(&name).await.map_err(|e| format!("volume {}: configmap {name}: {e}", v.name))?;
            let data = cm.data.unwrap_or_default().into_iter().map(|(k, s)| (k, s.into_bytes())).collect();
            Some((data, c.default_mode.unwrap_or(0o644)))
        } else if let Some(p) = &v.projected {
            let mut data = BTreeMap::new();
            for src in p.sources.iter().flatten() {
                if let Some(t) = &src.service_account_token {
                    let token = token.ok_or_else(|| format!("volume {}: no service-account token for this pod", v.name))?;
                    data.insert(t.path.clone(), token.as_bytes().to_vec());
                } else if let Some(c) = &src.config_map {
                    let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
                        .get(&c.name)
                        .await
                        .map_err(|e| format!("volume {}: configmap {}: {e}", v.name, c.name))?;
                    let values = cm.data.unwrap_or_default();
                    for item in c.items.iter().flatten() {
                        data.insert(item.path.clone(), values.get(&item.key).cloned().unwrap_or_default().into_bytes());
                    }
                } else if let Some(d) = &src.downward_api {
                    for item in d.items.iter().flatten() {
                        let field = item.field_ref.as_ref().map(|f| f.field_path.as_str()).unwrap_or("");
                        let value = super::env::field(pod, field, "", "").ok_or_else(|| format!("volume {}: field {field} is not supported", v.name))?;
                        data.insert(item.path.clone(), value.into_bytes());
                    }
                }
            }
            Some((data, p.default_mode.unwrap_or(0o644)))
        } else if v.empty_dir.is_some() {
            Some((BTreeMap::new(), 0))
        } else if let Some(h) = &v.host_path {
            out.insert(v.name.clone(), PathBuf::from(&h.path));
            None
        } else if let Some(c) = &v.persistent_volume_claim {
            out.insert(v.name.clone(), claimed(client, ns, &c.claim_name).await.map_err(|e| format!("volume {}: {e}", v.name))?);
            None
        } else {
            return Err(format!(
                "volume {}: only secret, configMap, emptyDir, projected, hostPath and persistentVolumeClaim volumes are supported by the kvgate node agent",
                v.name
            ));
        };
        if let Some((files, mode)) = files {
            std::fs::create_dir_all(&path).map_err(|e| format!("volume {}: {e}", v.name))?;
            if v.empty_dir.is_some() {
                // Writable by whichever user the containers run as, as the kubelet makes it.
                let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777));
            }
            write_files(&path, &files, mode, fs_group).map_err(|e| format!("volume {}: {e}", v.name))?;
            out.insert(v.name.clone(), path);
        }
    }
    Ok(out)
}

/// The directory of the PersistentVolume the claim `name` is bound to.
async fn claimed(client: &kube::Client, ns: &str, name: &str) -> Result<PathBuf, String> {
    let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns).get(name).await.map_err(|e| format!("persistentvolumeclaim {name}: {e}"))?;
    let bound = claim.spec.and_then(|s| s.volume_name).filter(|v| !v.is_empty());
    let volume = bound.ok_or_else(|| format!("persistentvolumeclaim {name:?} is not bound"))?;
    let pv = Api::<PersistentVolume>::all(client.clone()).get(&volume).await.map_err(|e| format!("persistentvolume {volume}: {e}"))?;
    let spec = pv.spec.unwrap_or_default();
    let path = spec.host_path.map(|h| h.path).or(spec.local.map(|l| l.path));
    path.map(PathBuf::from).ok_or_else(|| format!("persistentvolume {volume}: only hostPath and local volumes can be mounted by the kvgate node agent"))
}

/// Writes each file whose bytes changed (aside, then renamed over the old one, so a reader sees
/// the old file or the new one, never half of one), with the volume's mode and the pod's group.
fn write_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>, mode: i32, fs_group: Option<u32>) -> Result<(), String> {
    for (key, bytes) in files {
        let file = dir.join(key);
        if std::fs::read(&file).is_ok_and(|old| old == *bytes) {
            continue;
        }
        let aside = dir.join(format!("..{key}.tmp"));
        std::fs::write(&aside, bytes).map_err(|e| format!("{key}: {e}"))?;
        let _ = std::fs::set_permissions(&aside, std::fs::Permissions::from_mode(mode as u32));
        if let Some(group) = fs_group {
            // As the kubelet applies fsGroup: the pod's group owns the file and may read it.
            let _ = std::os::unix::fs::chown(&aside, Some(0), Some(group));
            let _ = std::fs::set_permissions(&aside, std::fs::Permissions::from_mode(mode as u32 | 0o440));
        }
        std::fs::rename(&aside, &file).map_err(|e| format!("{key}: {e}"))?;
    }
    Ok(())
}

/// Each Secret's data as read this round, by (namespace, name); `None`: the Secret is gone.
pub type SecretCache = BTreeMap<(String, String), Option<BTreeMap<String, Vec<u8>>>>;

/// Brings a running pod's Secret volumes up to date with their Secrets: changed keys rewritten,
/// removed ones deleted, as the kubelet does for a mounted Secret. `secrets` caches each
/// Secret's data for this round (one GET per Secret, however many pods mount it).
pub async fn refresh_secrets(client: &kube::Client, pod: &Pod, dir: &Path, secrets: &mut SecretCache) -> Result<(), String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let fs_group = pod.spec.as_ref().and_then(|s| s.security_context.as_ref()).and_then(|c| c.fs_group).and_then(|g| u32::try_from(g).ok());
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let Some(s) = &v.secret else { continue };
        let name = s.secret_name.clone().unwrap_or_default();
        let key = (ns.to_string(), name.clone());
        if !secrets.contains_key(&key) {
            let got = Api::<Secret>::namespaced(client.clone(), ns).get_opt(&name).await.map_err(|e| format!("secret {name}: {e}"))?;
            secrets.insert(key.clone(), got.map(|s| s.data.unwrap_or_default().into_iter().map(|(k, b)| (k, b.0)).collect()));
        }
        // A Secret deleted under a running pod leaves its files as they were (so does the kubelet).
        let Some(Some(files)) = secrets.get(&key) else { continue };
        let path = dir.join("volumes").join(&v.name);
        if !path.is_dir() {
            continue;
        }
        write_files(&path, files, s.default_mode.unwrap_or(0o644), fs_group).map_err(|e| format!("volume {}: {e}", v.name))?;
        for entry in std::fs::read_dir(&path).map_err(|e| format!("volume {}: {e}", v.name))?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("..") && !files.contains_key(&name) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(())
}

/// A bind mount for one container, prepared before fork so the child only makes syscalls.
#[derive(Debug)]
pub struct Bind {
    source: CString,
    target: CString,
    read_only: bool,
}

/// The container's volume mounts: each volume's directory at its `mountPath`.
pub fn mounts(c: &Container, volumes: &BTreeMap<String, PathBuf>) -> Result<Vec<Mount>, String> {
    c.volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            let source = volumes.get(&m.name).ok_or_else(|| format!("volumeMount {}: no volume of that name", m.name))?;
            Ok(Mount { source: source.clone(), destination: m.mount_path.clone(), read_only: m.read_only == Some(true) })
        })
        .collect()
}

/// The mounts of a container run as a host process; creates each mount point on the host (an
/// empty directory, harmless).
pub fn binds(c: &Container, volumes: &BTreeMap<String, PathBuf>) -> Result<Vec<Bind>, String> {
    mounts(c, volumes)?
        .into_iter()
        .map(|m| {
            std::fs::create_dir_all(&m.destination).map_err(|e| format!("volumeMount {}: {e}", m.destination))?;
            let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|e| e.to_string());
            Ok(Bind { source: c(&m.source)?, target: c(Path::new(&m.destination))?, read_only: m.read_only })
        })
        .collect()
}

/// In the forked child: a private mount namespace with the binds. Only async-signal-safe calls.
pub fn enter(binds: &[Bind]) -> std::io::Result<()> {
    if binds.is_empty() {
        return Ok(());
    }
    let check = |r: i32| if r == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    // SAFETY: plain syscalls on pointers to NUL-terminated strings that outlive the calls.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()))?;
        for b in binds {
            check(libc::mount(b.source.as_ptr(), b.target.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()))?;
            if b.read_only {
                let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                check(libc::mount(std::ptr::null(), b.target.as_ptr(), std::ptr::null(), flags, std::ptr::null()))?;
            }
        }
    }
    Ok(())
}
