//! Container logs as the kubelet serves them: the current run's file, the previous run's file
//! (rotated when a container restarts), the last N lines, a byte limit, and following a running
//! container until it exits.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;

/// The current run's output.
pub fn current(dir: &Path, container: &str) -> PathBuf {
    dir.join(format!("{container}.log"))
}

/// The output of the run before it: what `kubectl logs --previous` shows.
pub fn previous(dir: &Path, container: &str) -> PathBuf {
    dir.join(format!("{container}.previous.log"))
}

/// A container about to start again: its last run's log becomes the previous one.
pub fn rotate(dir: &Path, container: &str) -> std::io::Result<()> {
    std::fs::rename(current(dir, container), previous(dir, container))
}

#[derive(Debug, Clone)]
struct PodEntry {
    uid: String,
    dir: PathBuf,
    /// Container name -> whether it is running now.
    running: BTreeMap<String, bool>,
}

/// What the node runs, by namespace and pod name, as the log endpoint looks it up. The agent
/// updates it on every sync.
#[derive(Debug, Clone, Default)]
pub struct LogIndex(Arc<Mutex<HashMap<(String, String), PodEntry>>>);

impl LogIndex {
    pub fn update(&self, ns: &str, pod: &str, uid: &str, dir: &Path, running: BTreeMap<String, bool>) {
        let entry = PodEntry { uid: uid.to_string(), dir: dir.to_path_buf(), running };
        self.0.lock().unwrap().insert((ns.to_string(), pod.to_string()), entry);
    }

    pub fn remove(&self, uid: &str) {
        self.0.lock().unwrap().retain(|_, e| e.uid != uid);
    }

    /// The network namespace of pod `ns/pod` on this node (from its `network.json`).
    pub fn netns(&self, ns: &str, pod: &str) -> Option<PathBuf> {
        let text = std::fs::read(self.entry(ns, pod)?.dir.join("network.json")).ok()?;
        let network: serde_json::Value = serde_json::from_slice(&text).ok()?;
        network["netns"].as_str().map(PathBuf::from)
    }

    fn entry(&self, ns: &str, pod: &str) -> Option<PodEntry> {
        self.0.lock().unwrap().get(&(ns.to_string(), pod.to_string())).cloned()
    }

    fn running(&self, ns: &str, pod: &str, uid: &str, container: &str) -> bool {
        self.entry(ns, pod).is_some_and(|e| e.uid == uid && e.running.get(container) == Some(&true))
    }
}

/// The `containerLogs` query parameters the node agent honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogRequest {
    pub follow: bool,
    pub previous: bool,
    pub tail_lines: Option<usize>,
    pub limit_bytes: Option<u64>,
}

impl LogRequest {
    /// Parses the query; options that need per-line timestamps (which this runtime does not
    /// record) are refused by name rather than ignored.
    pub fn parse(query: &HashMap<String, String>) -> Result<Self, String> {
        let flag = |k: &str| query.get(k).is_some_and(|v| v == "true" || v == "1");
        let number = |k: &str| -> Result<Option<u64>, String> {
            query.get(k).map(|v| v.parse::<u64>().map_err(|_| format!("{k}={v:?} is not a non-negative integer"))).transpose()
        };
        for unsupported in ["timestamps", "sinceSeconds", "sinceTime"] {
            if query.get(unsupported).is_some_and(|v| !v.is_empty() && v != "false") {
                return Err(format!("{unsupported} is not supported: the kvgate node agent does not record per-line timestamps"));
            }
        }
        Ok(LogRequest {
            follow: flag("follow"),
            previous: flag("previous"),
            tail_lines: number("tailLines")?.map(|n| n as usize),
            limit_bytes: number("limitBytes")?,
        })
    }
}

/// Why a log cannot be served, with the HTTP status the kubelet uses for it.
#[derive(Debug, PartialEq)]
pub enum LogError {
    NotFound(String),
    BadRequest(String),
}

/// The log stream for one container: the bytes written so far (after `tailLines`), then, when
/// following a running container, what it writes until it exits or restarts.
pub fn open(
    index: &LogIndex,
    ns: &str,
    pod: &str,
    container: &str,
    req: &LogRequest,
) -> Result<impl Stream<Item = std::io::Result<Vec<u8>>> + Send + 'static, LogError> {
    let entry = index.entry(ns, pod).ok_or_else(|| LogError::NotFound(format!("pod {ns}/{pod} is not running on this node")))?;
    if !entry.running.contains_key(container) {
        return Err(LogError::NotFound(format!("container {container:?} is not in pod {ns}/{pod}")));
    }
    let path = if req.previous { previous(&entry.dir, container) } else { current(&entry.dir, container) };
    let mut file = std::fs::File::open(&path).map_err(|_| {
        if req.previous {
            LogError::BadRequest(format!("previous terminated container {container:?} in pod {pod:?} not found"))
        } else {
            LogError::BadRequest(format!("container {container:?} in pod {pod:?} is waiting to start"))
        }
    })?;
    let start = match req.tail_lines {
        Some(n) => tail_offset(&mut file, n).map_err(|e| LogError::BadRequest(format!("{}: {e}", path.display())))?,
        None => 0,
    };
    let inode = file.metadata().map(|m| m.ino()).unwrap_or(0);
    let follow = req.follow && !req.previous;
    let state = Follow {
        file,
        offset: start,
        inode,
        path,
        left: req.limit_bytes.unwrap_or(u64::MAX),
        follow: follow.then(|| (index.clone(), ns.to_string(), pod.to_string(), entry.uid, container.to_string())),
        done: false,
    };
    Ok(futures::stream::unfold(state, |mut s| async move {
        match s.next().await {
            Ok(Some(chunk)) => Some((Ok(chunk), s)),
            Ok(None) => None,
            Err(e) => {
                s.done = true;
                Some((Err(e), s))
            }
        }
    }))
}

struct Follow {
    file: std::fs::File,
    offset: u64,
    inode: u64,
    path: PathBuf,
    left: u64,
    /// Set when following: whom to ask whether the container still runs.
    follow: Option<(LogIndex, String, String, String, String)>,
    done: bool,
}

impl Follow {
    const POLL: Duration = Duration::from_millis(100);

    async fn next(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            if self.done || self.left == 0 {
                return Ok(None);
            }
            let chunk = self.read()?;
            if !chunk.is_empty() {
                return Ok(Some(chunk));
            }
            let Some((index, ns, pod, uid, container)) = &self.follow else { return Ok(None) };
            // The run ended (or a new one started in a new file): what it wrote is all there is.
            let rotated = std::fs::metadata(&self.path).map(|m| m.ino() != self.inode).unwrap_or(true);
            if rotated || !index.running(ns, pod, uid, container) {
                self.done = true;
                let rest = self.read()?;
                return Ok((!rest.is_empty()).then_some(rest));
            }
            tokio::time::sleep(Self::POLL).await;
        }
    }

    fn read(&mut self) -> std::io::Result<Vec<u8>> {
        self.file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        (&mut self.file).take(self.left.min(1 << 20)).read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        self.left -= buf.len() as u64;
        Ok(buf)
    }
}

/// Where the last `n` lines of the file begin (a final line without a newline counts).
fn tail_offset(file: &mut std::fs::File, n: usize) -> std::io::Result<u64> {
    let mut text = Vec::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_end(&mut text)?;
    Ok(tail_start(&text, n) as u64)
}

fn tail_start(text: &[u8], n: usize) -> usize {
    if n == 0 {
        return text.len();
    }
    // Ignore the newline that ends the last line, then find the n-th newline from the end.
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    body.iter().enumerate().rev().filter(|(_, b)| **b == b'\n').nth(n - 1).map_or(0, |(i, _)| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_counts_lines_from_the_end() {
        let text = b"a\nb\nc\n";
        assert_eq!(&text[tail_start(text, 1)..], b"c\n");
        assert_eq!(&text[tail_start(text, 2)..], b"b\nc\n");
        assert_eq!(&text[tail_start(text, 9)..], text);
        assert_eq!(&text[tail_start(text, 0)..], b"");
        assert_eq!(&b"a\nb"[tail_start(b"a\nb", 1)..], b"b");
    }

    #[test]
    fn timestamps_are_refused_by_name_and_numbers_checked() {
        let q = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>();
        assert!(LogRequest::parse(&q(&[("timestamps", "true")])).unwrap_err().contains("timestamps"));
        assert!(LogRequest::parse(&q(&[("tailLines", "-1")])).unwrap_err().contains("tailLines"));
        let r = LogRequest::parse(&q(&[("follow", "true"), ("tailLines", "3"), ("limitBytes", "10")])).unwrap();
        assert_eq!(r, LogRequest { follow: true, previous: false, tail_lines: Some(3), limit_bytes: Some(10) });
    }
}
