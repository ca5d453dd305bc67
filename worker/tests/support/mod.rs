//! Starts a real `kvgate-worker` process on a free loopback port and talks to it over HTTP.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

pub struct Worker {
    pub child: Child,
    /// The line in which the worker reported where it listens.
    pub line: String,
    pub base: String,
    pub http: reqwest::Client,
}

impl Worker {
    /// `kvgate-worker local --colocated` (one engine, no handoff) with `args`.
    pub fn colocated(args: &[&str]) -> Worker {
        let mut all = vec!["--colocated"];
        all.extend_from_slice(args);
        Worker::local(&all)
    }

    /// `kvgate-worker local` (router, prefill and decode over loopback sockets) with `args`.
    pub fn local(args: &[&str]) -> Worker {
        let mut full = vec!["local", "--listen", "127.0.0.1:0"];
        full.extend_from_slice(args);
        Worker::spawn(&full)
    }

    /// Any `kvgate-worker` serving command; it reports its address on the last line of its
    /// start-up output (`... listening on http://ADDR ...`).
    pub fn spawn(args: &[&str]) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate-worker"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvgate-worker");
        let stdout = child.stdout.take().unwrap();
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        while !line.contains("listening on") {
            line.clear();
            if reader.read_line(&mut line).expect("read the worker's output") == 0 {
                panic!("kvgate-worker {args:?} exited before listening");
            }
        }
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("worker did not report its address: {line:?}"))
            .to_string();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        Worker { child, base: format!("http://{addr}"), http, line }
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {text}"));
        (status, value)
    }

    pub async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).body(body.to_string()).send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// Greedy completion text of `prompt`.
    pub async fn complete(&self, prompt: &str, max_tokens: u32) -> String {
        let (status, body) = self.post("/v1/completions", &serde_json::json!({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0
        })).await;
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["text"].as_str().unwrap().to_string()
    }

    /// The value of one sample line of `/metrics`, e.g. `kvgate_requests_total{code="200",role="local"}`.
    pub async fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no series {series} in /metrics:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// Raw SSE `data:` payloads of a streaming request.
    pub async fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let resp = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let datas = text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect();
        (status, datas)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
