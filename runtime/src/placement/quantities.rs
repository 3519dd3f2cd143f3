//! Named resource quantities (milli-CPUs, memory bytes, GPUs, custom names) with exact
//! integer arithmetic, and what a node offers: its quantities and its GPU indices.

use std::collections::BTreeMap;
use std::fmt;

use crate::resources::NodeResources;

/// Named quantities: what a node offers, what a request needs, what is in use. Integers
/// only, so sums and differences are exact. A name that is absent has the amount 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Resources {
    /// Never holds a zero amount, so equal quantities compare equal.
    amounts: BTreeMap<String, u64>,
}

impl Resources {
    /// CPUs, counted in thousandths (`1500` is one and a half CPUs).
    pub const CPU: &'static str = "cpu";
    /// Memory, in bytes.
    pub const MEMORY: &'static str = "memory";
    /// GPUs, whole ones.
    pub const GPU: &'static str = "gpu";

    /// Nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `cpus` whole CPUs.
    pub fn with_cpus(self, cpus: u64) -> Self {
        self.with(Self::CPU, cpus.saturating_mul(1000))
    }

    /// With `millis` thousandths of a CPU.
    pub fn with_cpu_millis(self, millis: u64) -> Self {
        self.with(Self::CPU, millis)
    }

    pub fn with_memory_bytes(self, bytes: u64) -> Self {
        self.with(Self::MEMORY, bytes)
    }

    pub fn with_gpus(self, gpus: u64) -> Self {
        self.with(Self::GPU, gpus)
    }

    /// With `amount` of the resource `name` (replacing what was there).
    pub fn with(mut self, name: impl Into<String>, amount: u64) -> Self {
        self.set(name, amount);
        self
    }

    /// Sets the amount of `name`; 0 removes it.
    pub fn set(&mut self, name: impl Into<String>, amount: u64) {
        let name = name.into();
        if amount == 0 {
            self.amounts.remove(&name);
        } else {
            self.amounts.insert(name, amount);
        }
    }

    /// The amount of `name`, 0 when absent.
    pub fn get(&self, name: &str) -> u64 {
        self.amounts.get(name).copied().unwrap_or(0)
    }

    pub fn cpu_millis(&self) -> u64 {
        self.get(Self::CPU)
    }

    pub fn memory_bytes(&self) -> u64 {
        self.get(Self::MEMORY)
    }

    pub fn gpus(&self) -> u64 {
        self.get(Self::GPU)
    }

    pub fn is_empty(&self) -> bool {
        self.amounts.is_empty()
    }

    /// The non-zero quantities, scarcest kind first: GPUs, custom resources by name, CPUs,
    /// memory. Placement compares nodes in this order, and messages list it.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        let mut items: Vec<(&str, u64)> = self
            .amounts
            .iter()
            .map(|(name, amount)| (name.as_str(), *amount))
            .collect();
        items.sort_by_key(|(name, _)| scarcity(name));
        items.into_iter()
    }

    /// Whether every quantity of `self` is at most that of `available`.
    pub fn fits_in(&self, available: &Resources) -> bool {
        self.amounts
            .iter()
            .all(|(name, amount)| *amount <= available.get(name))
    }

    /// The sum, each quantity saturating at `u64::MAX`.
    pub fn saturating_add(&self, other: &Resources) -> Resources {
        let mut sum = self.clone();
        for (name, amount) in &other.amounts {
            let total = sum.get(name).saturating_add(*amount);
            sum.set(name.as_str(), total);
        }
        sum
    }

    /// The difference, each quantity stopping at 0.
    pub fn saturating_sub(&self, other: &Resources) -> Resources {
        let mut difference = self.clone();
        for (name, amount) in &other.amounts {
            let left = difference.get(name).saturating_sub(*amount);
            difference.set(name.as_str(), left);
        }
        difference
    }
}

impl fmt::Display for Resources {
    /// `1 gpu, 2 tpu, 1.5 cpu, 4 GiB memory`, or `nothing`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("nothing");
        }
        for (i, (name, amount)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", Amount::named(name, amount))?;
        }
        Ok(())
    }
}

/// An amount of one resource for people to read: `1.5` or `1.5 cpu`, `4 GiB` or
/// `4 GiB memory`, `2` or `2 gpu`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Amount<'a> {
    name: &'a str,
    amount: u64,
    with_name: bool,
}

impl<'a> Amount<'a> {
    /// The amount followed by the resource's name.
    pub(crate) fn named(name: &'a str, amount: u64) -> Self {
        Amount {
            name,
            amount,
            with_name: true,
        }
    }

    /// The amount alone (with its unit, for memory).
    pub(crate) fn bare(name: &'a str, amount: u64) -> Self {
        Amount {
            name,
            amount,
            with_name: false,
        }
    }
}

impl fmt::Display for Amount<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name {
            Resources::CPU => {
                let (whole, millis) = (self.amount / 1000, self.amount % 1000);
                if millis == 0 {
                    write!(f, "{whole}")?;
                } else {
                    let fraction = format!("{millis:03}");
                    write!(f, "{whole}.{}", fraction.trim_end_matches('0'))?;
                }
            }
            Resources::MEMORY => {
                let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
                let (mut value, mut unit) = (self.amount, 0);
                while unit + 1 < units.len() && value >= 1024 && value % 1024 == 0 {
                    value /= 1024;
                    unit += 1;
                }
                write!(f, "{value} {}", units[unit])?;
            }
            _ => write!(f, "{}", self.amount)?,
        }
        if self.with_name {
            write!(f, " {}", self.name)?;
        }
        Ok(())
    }
}

/// What a node offers: its quantities, and which GPUs its `gpu` quantity is made of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeCapacity {
    resources: Resources,
    gpu_indices: Vec<u32>,
}

impl NodeCapacity {
    /// `resources`, its GPUs being numbered `0..gpus`.
    pub fn new(resources: Resources) -> Self {
        let count = u32::try_from(resources.gpus()).unwrap_or(u32::MAX);
        NodeCapacity {
            gpu_indices: (0..count).collect(),
            resources,
        }
    }

    /// The same with these GPUs (indices as the node's workers will see them in
    /// `CUDA_VISIBLE_DEVICES`, duplicates dropped); the `gpu` quantity becomes their count.
    pub fn with_gpu_indices(mut self, indices: impl IntoIterator<Item = u32>) -> Self {
        self.gpu_indices.clear();
        for index in indices {
            if !self.gpu_indices.contains(&index) {
                self.gpu_indices.push(index);
            }
        }
        let count = self.gpu_indices.len() as u64;
        self.resources.set(Resources::GPU, count);
        self
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// The node's GPUs, in the order they are handed out.
    pub fn gpu_indices(&self) -> &[u32] {
        &self.gpu_indices
    }
}

impl From<Resources> for NodeCapacity {
    fn from(resources: Resources) -> Self {
        NodeCapacity::new(resources)
    }
}

impl From<&NodeResources> for NodeCapacity {
    /// What a node discovered: its CPUs, its memory when known, its GPUs by index.
    fn from(node: &NodeResources) -> Self {
        let resources = Resources::new()
            .with_cpus(node.cpus as u64)
            .with_memory_bytes(node.memory_bytes.unwrap_or(0));
        NodeCapacity::new(resources).with_gpu_indices(node.gpus.iter().map(|gpu| gpu.index))
    }
}

/// The order in which placement weighs resources and messages list them: GPUs, custom
/// resources by name, CPUs, memory.
pub(crate) fn scarcity(name: &str) -> (u8, &str) {
    let rank = match name {
        Resources::GPU => 0,
        Resources::CPU => 2,
        Resources::MEMORY => 3,
        _ => 1,
    };
    (rank, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{GpuInfo, GpuSource};

    #[test]
    fn quantities_read_well() {
        let gib = 1024 * 1024 * 1024;
        let cases = [
            (Resources::new(), "nothing"),
            (Resources::new().with_cpus(2), "2 cpu"),
            (Resources::new().with_cpu_millis(1500), "1.5 cpu"),
            (Resources::new().with_cpu_millis(250), "0.25 cpu"),
            (Resources::new().with_cpu_millis(1001), "1.001 cpu"),
            (Resources::new().with_memory_bytes(4 * gib), "4 GiB memory"),
            (
                Resources::new().with_memory_bytes(1536 * 1024 * 1024),
                "1536 MiB memory",
            ),
            (
                Resources::new().with_memory_bytes(1000),
                "1000 bytes memory",
            ),
            (
                Resources::new()
                    .with_memory_bytes(gib)
                    .with_cpus(8)
                    .with("tpu", 2)
                    .with_gpus(1)
                    .with("fpga", 1),
                "1 gpu, 1 fpga, 2 tpu, 8 cpu, 1 GiB memory",
            ),
            (Resources::new().with_gpus(2).with_gpus(0), "nothing"),
        ];
        for (resources, want) in cases {
            assert_eq!(resources.to_string(), want, "{resources:?}");
        }
        assert_eq!(Amount::bare(Resources::GPU, 2).to_string(), "2");
        assert_eq!(
            Amount::bare(Resources::MEMORY, 2 * gib).to_string(),
            "2 GiB"
        );
    }

    #[test]
    fn arithmetic_is_exact_and_ignores_zeros() {
        let node = Resources::new().with_cpus(4).with_gpus(2).with("tpu", 1);
        let small = Resources::new().with_cpu_millis(500).with_gpus(1);
        let cases = [
            (small.clone(), true),
            (node.clone(), true),
            (Resources::new(), true),
            (Resources::new().with_gpus(3), false),
            (Resources::new().with("fpga", 1), false),
            (Resources::new().with_cpu_millis(4001), false),
        ];
        for (request, fits) in cases {
            assert_eq!(request.fits_in(&node), fits, "{request}");
        }
        let left = node.saturating_sub(&small);
        assert_eq!(left.to_string(), "1 gpu, 1 tpu, 3.5 cpu");
        assert_eq!(left.saturating_add(&small), node);
        assert_eq!(node.saturating_sub(&node), Resources::new());
        assert_eq!(small.saturating_sub(&node), Resources::new());
        let huge = Resources::new().with_gpus(u64::MAX);
        assert_eq!(huge.saturating_add(&huge).gpus(), u64::MAX);
        assert_eq!(Resources::new().with_cpus(u64::MAX).cpu_millis(), u64::MAX);
    }

    #[test]
    fn capacity_numbers_its_gpus() {
        let cases: Vec<(NodeCapacity, Vec<u32>, u64)> = vec![
            (Resources::new().with_gpus(3).into(), vec![0, 1, 2], 3),
            (Resources::new().with_cpus(2).into(), vec![], 0),
            (
                NodeCapacity::new(Resources::new().with_gpus(8)).with_gpu_indices([5, 2, 5]),
                vec![5, 2],
                2,
            ),
            (
                NodeCapacity::new(Resources::new().with_gpus(1)).with_gpu_indices([]),
                vec![],
                0,
            ),
        ];
        for (capacity, indices, gpus) in cases {
            assert_eq!(capacity.gpu_indices(), indices.as_slice(), "{capacity:?}");
            assert_eq!(capacity.resources().gpus(), gpus, "{capacity:?}");
        }
    }

    #[test]
    fn capacity_of_a_discovered_node() {
        let gpu = |index| GpuInfo {
            index,
            name: "claimed Resources::GPU".to_string(),
            memory_bytes: None,
            uuid: format!("claimed-{index}"),
            source: GpuSource::Claimed,
        };
        let node = NodeResources {
            cpus: 16,
            memory_bytes: Some(64 << 30),
            gpus: vec![gpu(2), gpu(3)],
            hostname: None,
        };
        let capacity = NodeCapacity::from(&node);
        assert_eq!(
            capacity.resources().to_string(),
            "2 gpu, 16 cpu, 64 GiB memory"
        );
        assert_eq!(capacity.gpu_indices(), [2, 3]);
        let unknown_memory = NodeResources {
            memory_bytes: None,
            gpus: vec![],
            ..node
        };
        assert_eq!(
            NodeCapacity::from(&unknown_memory).resources().to_string(),
            "16 cpu"
        );
    }
}
