//! The demo's pipeline: stage configs chained by their topics.
//!
//! The demo runs whatever stage configs a directory holds, so the order of the stages comes
//! from the configs themselves (each stage reads what the one before it writes), not from file
//! names; a set that is not one linear chain ending in an output topic is refused. Against a
//! real broker every topic and group gets the run's suffix, so runs never read each other's
//! records.

use std::collections::HashSet;
use std::path::Path;

use sessionflow_worker::config::StageConfig;

/// The stages of a linear pipeline, in record order.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub stages: Vec<StageConfig>,
}

impl Pipeline {
    /// Reads every `*.yaml` in `dir` and chains them.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let mut configs = Vec::new();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| anyhow::anyhow!("reading the stage configs in {}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let config = StageConfig::parse_file(&path)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                configs.push(config);
            }
        }
        Self::chain(configs)
    }

    /// Orders stages so that each one's output is the next one's input.
    pub fn chain(mut configs: Vec<StageConfig>) -> anyhow::Result<Self> {
        anyhow::ensure!(!configs.is_empty(), "no stage configs");
        let outputs: HashSet<String> = configs.iter().filter_map(|c| c.output.clone()).collect();
        let firsts: Vec<usize> = (0..configs.len())
            .filter(|i| !outputs.contains(&configs[*i].input))
            .collect();
        anyhow::ensure!(
            firsts.len() == 1,
            "the stages must form one chain: {} of them read a topic no stage writes",
            firsts.len()
        );
        let mut stages = vec![configs.remove(firsts[0])];
        while let Some(out) = stages.last().and_then(|s| s.output.clone()) {
            let Some(next) = configs.iter().position(|c| c.input == out) else {
                break;
            };
            stages.push(configs.remove(next));
        }
        anyhow::ensure!(
            configs.is_empty(),
            "the stages must form one chain; not in it: {}",
            configs
                .iter()
                .map(|c| c.stage.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        anyhow::ensure!(
            stages.last().is_some_and(|s| s.output.is_some()),
            "the last stage needs an output topic (it is what gets verified)"
        );
        let names: HashSet<&str> = stages.iter().map(|s| s.stage.as_str()).collect();
        anyhow::ensure!(names.len() == stages.len(), "stage names must be unique");
        Ok(Self { stages })
    }

    /// The topic the load goes to.
    pub fn input(&self) -> &str {
        &self.stages[0].input
    }

    /// The last stage's output.
    pub fn output(&self) -> &str {
        self.stages
            .last()
            .and_then(|s| s.output.as_deref())
            .unwrap_or_default()
    }

    /// The dead-letter topics, each once.
    pub fn dlqs(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for s in &self.stages {
            if !v.contains(&s.dlq.as_str()) {
                v.push(&s.dlq);
            }
        }
        v
    }

    /// Every topic, each once: the input, the outputs in order, the DLQs.
    pub fn topics(&self) -> Vec<&str> {
        let mut v = vec![self.input()];
        v.extend(self.stages.iter().filter_map(|s| s.output.as_deref()));
        for d in self.dlqs() {
            if !v.contains(&d) {
                v.push(d);
            }
        }
        v
    }

    /// The same pipeline with `-<suffix>` on every topic and group.
    pub fn suffixed(mut self, suffix: &str) -> Self {
        let rename = |t: &str| format!("{t}-{suffix}");
        for s in &mut self.stages {
            s.group = Some(rename(&s.group_id()));
            s.input = rename(&s.input);
            s.output = s.output.as_deref().map(rename);
            s.dlq = rename(&s.dlq);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_configs() -> Vec<StageConfig> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/demo");
        Pipeline::load(&dir).unwrap().stages
    }

    #[test]
    fn the_shipped_demo_is_a_four_stage_chain() {
        let p = Pipeline::chain(demo_configs()).unwrap();
        let names: Vec<&str> = p.stages.iter().map(|s| s.stage.as_str()).collect();
        assert_eq!(names, ["ingest", "nlu", "llm", "delivery"]);
        assert_eq!(p.input(), "chat-in");
        assert_eq!(p.output(), "chat-delivered");
        assert_eq!(p.dlqs(), ["chat-dlq"]);
        assert_eq!(p.topics().len(), 6);
        let ports: HashSet<u16> = p
            .stages
            .iter()
            .map(|s| s.metrics_addr.unwrap().port())
            .collect();
        assert_eq!(ports.len(), 4, "each stage its own metrics port");
    }

    #[test]
    fn chain_order_does_not_depend_on_file_order() {
        let mut configs = demo_configs();
        configs.reverse();
        let p = Pipeline::chain(configs).unwrap();
        assert_eq!(p.stages[0].stage, "ingest");
        assert_eq!(p.stages[3].stage, "delivery");
    }

    #[test]
    fn a_broken_chain_is_refused() {
        let mut configs = demo_configs();
        configs.retain(|c| c.stage != "nlu");
        assert!(Pipeline::chain(configs).is_err());
        let mut configs = demo_configs();
        configs.iter_mut().for_each(|c| {
            if c.stage == "delivery" {
                c.output = None;
            }
        });
        assert!(
            Pipeline::chain(configs).is_err(),
            "the last stage needs an output"
        );
    }

    #[test]
    fn suffixing_renames_topics_and_groups_consistently() {
        let p = Pipeline::chain(demo_configs()).unwrap().suffixed("7");
        assert_eq!(p.input(), "chat-in-7");
        assert_eq!(p.stages[1].input, "chat-ingested-7");
        assert_eq!(p.stages[0].output.as_deref(), Some("chat-ingested-7"));
        assert_eq!(p.stages[2].group.as_deref(), Some("sessionflow-demo-llm-7"));
        assert_eq!(p.dlqs(), ["chat-dlq-7"]);
        assert!(Pipeline::chain(p.stages).is_ok());
    }

    #[test]
    fn generated_configs_read_back_the_same() {
        for c in demo_configs() {
            let text = serde_saphyr::to_string(&c).unwrap();
            let back = StageConfig::parse(&text).unwrap();
            assert_eq!(serde_saphyr::to_string(&back).unwrap(), text, "{}", c.stage);
        }
    }
}
