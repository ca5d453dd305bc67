//! The values table of the chart's README, from the `# --` comments of `values.yaml` (the
//! helm-docs convention): every documented key as a row with its dotted path, its default as
//! written in the file, and its description.

/// A documented value.
#[derive(Debug, PartialEq)]
pub struct Row {
    pub key: String,
    pub default: String,
    pub description: String,
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The documented keys of `values`, in file order.
pub fn rows(values: &str) -> Vec<Row> {
    let lines: Vec<&str> = values.lines().collect();
    let mut out = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut doc: Option<String> = None;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if let Some(text) = trimmed.strip_prefix("# -- ") {
            doc = Some(text.to_string());
            continue;
        }
        if let Some(text) = trimmed.strip_prefix('#') {
            if let Some(d) = doc.as_mut() {
                d.push(' ');
                d.push_str(text.trim());
            }
            continue;
        }
        if trimmed.is_empty() || trimmed.starts_with('-') {
            continue;
        }
        let Some((key, value)) = trimmed.split_once(':') else { continue };
        let depth = indent(line);
        path.retain(|(d, _)| *d < depth);
        path.push((depth, key.to_string()));
        let Some(description) = doc.take() else { continue };
        let mut default = value.trim().to_string();
        if default.is_empty() {
            // A block: the lines below that are indented deeper, joined.
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || indent(l) > depth)
                .map(|l| l.trim())
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .collect();
            default = block.join("; ");
        }
        out.push(Row { key: path.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>().join("."), default, description });
    }
    out
}

/// The rows as a Markdown table.
pub fn markdown(values: &str) -> String {
    let mut s = String::from("| Key | Default | Description |\n| --- | --- | --- |\n");
    for r in rows(values) {
        let default = if r.default.is_empty() { String::new() } else { format!("`{}`", r.default.replace('|', "\\|")) };
        s += &format!("| `{}` | {default} | {} |\n", r.key, r.description.replace('|', "\\|"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_keys_get_their_path_default_and_description() {
        let values = "# header\n\nimage:\n  # -- Repository.\n  repository: ghcr.io/x\n  # -- Tag,\n  # two lines.\n  tag: \"\"\nundocumented: 1\n# -- Limits.\nresources:\n  limits: {cpu: 1}\n  requests: {cpu: 2}\n";
        let rows = rows(values);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], Row { key: "image.repository".into(), default: "ghcr.io/x".into(), description: "Repository.".into() });
        assert_eq!(rows[1].description, "Tag, two lines.");
        assert_eq!(rows[1].default, "\"\"");
        assert_eq!(rows[2].key, "resources");
        assert_eq!(rows[2].default, "limits: {cpu: 1}; requests: {cpu: 2}");
    }
}
