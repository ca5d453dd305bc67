//! API keys, one tenant per file of a directory (a mounted Kubernetes Secret: each data key is a
//! tenant's name, its value that tenant's keys, one per line). Only the keys' hashes are kept.
//! The directory is read again every few seconds: the kubelet rewrites a mounted Secret in place
//! when it changes, so keys are added, rotated and revoked without a restart. A directory that no
//! longer parses leaves the last good keys in force (and says why in the log and a counter).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::name::TenantName;

/// Shortest key accepted: a guessable key is no authentication.
pub const MIN_KEY_LEN: usize = 16;

/// How often the directory is read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// A key as kept: its BLAKE3 hash.
type KeyHash = [u8; 32];

fn hash(key: &str) -> KeyHash {
    kvgate_proto::auth::body_hash(key.as_bytes()).0
}

/// The keys in force: key hash -> tenant.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Keys {
    by_hash: HashMap<KeyHash, TenantName>,
}

impl Keys {
    /// Parses a directory as the Secret is mounted: every regular file whose name does not start
    /// with `.` (the kubelet's `..data` links do) is a tenant.
    pub fn read(dir: &Path) -> Result<Keys, String> {
        let entries = std::fs::read_dir(dir).map_err(|e| format!("--api-keys {}: {e}", dir.display()))?;
        let mut files: Vec<(String, PathBuf)> = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            // `metadata` follows the kubelet's symlinks to the file itself.
            if name.starts_with('.') || !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                continue;
            }
            files.push((name, path));
        }
        files.sort();
        let mut parsed = Vec::with_capacity(files.len());
        for (name, path) in files {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("--api-keys {}: {e}", path.display()))?;
            parsed.push((name, text));
        }
        Keys::parse(parsed.iter().map(|(n, t)| (n.as_str(), t.as_str())))
    }

    /// Tenants and their files' text: keys one per line, blank lines and `#` comments skipped.
    /// Errors name the tenant and the line, never a key.
    pub fn parse<'a>(tenants: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Keys, String> {
        let mut by_hash: HashMap<KeyHash, TenantName> = HashMap::new();
        for (name, text) in tenants {
            let tenant = TenantName::parse(name).map_err(|e| format!("API key file `{name}`: {e}"))?;
            for (n, line) in text.lines().enumerate() {
                let key = line.trim();
                if key.is_empty() || key.starts_with('#') {
                    continue;
                }
                if key.len() < MIN_KEY_LEN {
                    return Err(format!("API key file `{name}` line {}: a key is {} characters, at least {MIN_KEY_LEN} are needed", n + 1, key.len()));
                }
                if let Some(other) = by_hash.insert(hash(key), tenant.clone()) {
                    return Err(format!("API key file `{name}` line {}: the same key is also tenant `{other}`'s; a key names one tenant", n + 1));
                }
            }
        }
        Ok(Keys { by_hash })
    }

    pub fn tenant(&self, key: &str) -> Option<&TenantName> {
        self.by_hash.get(&hash(key))
    }

    /// Tenants with at least one key, in name order.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_hash.values().map(|t| t.to_string()).collect();
        names.sort();
        names.dedup();
        names
    }

    pub fn tenants(&self) -> usize {
        self.names().len()
    }
}

/// The keys in force, swapped whole when the directory changes.
#[derive(Debug)]
pub struct KeyRing {
    dir: PathBuf,
    keys: RwLock<Arc<Keys>>,
}

/// What one reading of the directory did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    Changed { tenants: usize },
    Failed(String),
}

impl KeyRing {
    /// Reads the directory once; an error here stops the process at start.
    pub fn open(dir: &Path) -> Result<Arc<KeyRing>, String> {
        let keys = Keys::read(dir)?;
        Ok(Arc::new(KeyRing { dir: dir.to_path_buf(), keys: RwLock::new(Arc::new(keys)) }))
    }

    pub fn current(&self) -> Arc<Keys> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the directory again; the keys change only when it parses.
    pub fn reload(&self) -> Reload {
        match Keys::read(&self.dir) {
            Err(e) => Reload::Failed(e),
            Ok(keys) if keys == *self.current() => Reload::Unchanged,
            Ok(keys) => {
                let tenants = keys.tenants();
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
                Reload::Changed { tenants }
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_their_tenant_and_are_kept_hashed() {
        let keys =
            Keys::parse([("acme", "# rotated 2026-12\nsk-acme-0123456789abcdef\n\nsk-acme-new-0123456789\n"), ("globex", "sk-globex-0123456789ab")]).unwrap();
        assert_eq!(keys.tenant("sk-acme-0123456789abcdef").map(|t| t.as_str()), Some("acme"));
        assert_eq!(keys.tenant("sk-acme-new-0123456789").map(|t| t.as_str()), Some("acme"));
        assert_eq!(keys.tenant("sk-globex-0123456789ab").map(|t| t.as_str()), Some("globex"));
        assert_eq!(keys.tenant("sk-unknown-0123456789"), None);
        assert_eq!(keys.tenants(), 2);
        assert!(!format!("{keys:?}").contains("sk-acme"), "only hashes are kept");
    }

    #[test]
    fn bad_files_are_refused_naming_the_tenant_and_line_never_the_key() {
        let short = Keys::parse([("acme", "sk-short")]).unwrap_err();
        assert_eq!(short, "API key file `acme` line 1: a key is 8 characters, at least 16 are needed");
        let shared = Keys::parse([("a", "sk-shared-0123456789"), ("b", "\nsk-shared-0123456789")]).unwrap_err();
        assert_eq!(shared, "API key file `b` line 2: the same key is also tenant `a`'s; a key names one tenant");
        assert!(Keys::parse([("no spaces", "sk-0123456789abcdef")]).unwrap_err().starts_with("API key file `no spaces`: "));
    }

    #[test]
    fn a_directory_is_read_again_and_a_broken_one_keeps_the_last_keys() {
        let dir = std::env::temp_dir().join(format!("kvgate-keys-{}", rand::random::<u64>()));
        std::fs::create_dir_all(dir.join("..2026_12_05")).unwrap();
        std::fs::write(dir.join("acme"), "sk-acme-0123456789abcdef\n").unwrap();
        let ring = KeyRing::open(&dir).unwrap();
        assert_eq!(ring.reload(), Reload::Unchanged);
        std::fs::write(dir.join("globex"), "sk-globex-0123456789ab\n").unwrap();
        assert_eq!(ring.reload(), Reload::Changed { tenants: 2 });
        std::fs::write(dir.join("acme"), "short\n").unwrap();
        assert!(matches!(ring.reload(), Reload::Failed(e) if e.contains("`acme` line 1")));
        assert!(ring.current().tenant("sk-acme-0123456789abcdef").is_some(), "the last good keys stay in force");
        std::fs::remove_file(dir.join("acme")).unwrap();
        assert_eq!(ring.reload(), Reload::Changed { tenants: 1 });
        assert!(ring.current().tenant("sk-acme-0123456789abcdef").is_none(), "a removed tenant's key is revoked");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
