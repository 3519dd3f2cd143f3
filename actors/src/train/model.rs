//! The image classifiers imgrun trains: a small CNN for quick runs and tch's ResNets,
//! each held with the `VarStore` that owns its variables.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use tch::nn::{self, ModuleT};
use tch::{Device, Kind, TchError, Tensor};

/// Which classifier to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    SmallCnn,
    Resnet18,
    Resnet34,
    Resnet50,
}

impl ModelKind {
    /// Every kind, in the order the error message of `from_str` lists them.
    pub const ALL: [ModelKind; 4] = [
        ModelKind::SmallCnn,
        ModelKind::Resnet18,
        ModelKind::Resnet34,
        ModelKind::Resnet50,
    ];

    /// The name used in configs and on the command line ("small_cnn", "resnet18", ...).
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::SmallCnn => "small_cnn",
            ModelKind::Resnet18 => "resnet18",
            ModelKind::Resnet34 => "resnet34",
            ModelKind::Resnet50 => "resnet50",
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ModelKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ModelKind::ALL
            .into_iter()
            .find(|kind| kind.name() == s)
            .ok_or_else(|| {
                let valid: Vec<&str> = ModelKind::ALL.iter().map(|kind| kind.name()).collect();
                format!("unknown model {s:?}; expected one of {}", valid.join(", "))
            })
    }
}

/// A classifier and the VarStore holding its variables. Must be `Send` (it lives in an actor thread).
#[derive(Debug)]
pub struct Model {
    kind: ModelKind,
    classes: i64,
    var_store: nn::VarStore,
    net: Box<dyn ModuleT>,
}

impl Model {
    /// `width`: channels of the small CNN's first block (ignored by ResNets). Initialises
    /// with the current tch RNG (callers seed with tch::manual_seed).
    pub fn new(
        kind: ModelKind,
        classes: i64,
        width: i64,
        device: Device,
    ) -> Result<Self, TchError> {
        if classes < 1 {
            return Err(TchError::Shape(format!(
                "a classifier needs 1 or more classes, got {classes}"
            )));
        }
        if kind == ModelKind::SmallCnn && width < 1 {
            return Err(TchError::Shape(format!(
                "the small CNN needs a width of 1 or more, got {width}"
            )));
        }
        // Building layers panics when the device cannot hold a tensor (say, CUDA without a
        // GPU); allocate one first so that case is an error value instead.
        let _probe = Tensor::f_zeros([1], (Kind::Float, device))?;
        let var_store = nn::VarStore::new(device);
        let root = var_store.root();
        let net: Box<dyn ModuleT> = match kind {
            ModelKind::SmallCnn => Box::new(small_cnn(&root, classes, width)),
            ModelKind::Resnet18 => Box::new(tch::vision::resnet::resnet18(&root, classes)),
            ModelKind::Resnet34 => Box::new(tch::vision::resnet::resnet34(&root, classes)),
            ModelKind::Resnet50 => Box::new(tch::vision::resnet::resnet50(&root, classes)),
        };
        Ok(Model {
            kind,
            classes,
            var_store,
            net,
        })
    }

    pub fn kind(&self) -> ModelKind {
        self.kind
    }

    pub fn classes(&self) -> i64 {
        self.classes
    }

    pub fn device(&self) -> Device {
        self.var_store.device()
    }

    /// Logits [N, classes] from float NCHW images; `train` selects BatchNorm's mode.
    pub fn forward_t(&self, images: &Tensor, train: bool) -> Tensor {
        self.net.forward_t(images, train)
    }

    /// Trainable parameters in a fixed order (sorted by name), the same on every process.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.named_variables(true)
    }

    /// Non-trainable state (BatchNorm running mean/var, ...) sorted by name; may be empty.
    pub fn buffers(&self) -> Vec<(String, Tensor)> {
        self.named_variables(false)
    }

    /// Stores every 4-D parameter (the convolutions' weights) channels-last (NHWC in
    /// memory, the same NCHW sizes and values), for cuDNN's NHWC kernels. Everything that
    /// later writes the parameters (checkpoint restore, `model.init`, broadcasts,
    /// averaging, the optimiser) copies into them in place, which keeps their layout, so
    /// once after building the model is enough; a gradient takes its parameter's layout.
    /// See [`channels_last_weights`] for when the trainer does it.
    pub fn use_channels_last_weights(&self) -> Result<(), TchError> {
        let _guard = tch::no_grad_guard();
        for (_, mut variable) in self.var_store.variables() {
            if variable.dim() == 4 {
                let channels_last = to_channels_last(&variable.f_detach()?)?;
                variable.f_set_data(&channels_last)?;
            }
        }
        Ok(())
    }

    pub fn var_store(&self) -> &nn::VarStore {
        &self.var_store
    }

    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.var_store
    }

    /// The store's variables that are (or are not) trainable, sorted by name. Trainable
    /// means registered as such in the store, not `requires_grad`, so a frozen store
    /// still reports the same split.
    fn named_variables(&self, trainable: bool) -> Vec<(String, Tensor)> {
        let trainable_storage: HashSet<usize> = self
            .var_store
            .trainable_variables()
            .iter()
            .map(|tensor| tensor.data_ptr() as usize)
            .collect();
        let mut named: Vec<(String, Tensor)> = self
            .var_store
            .variables()
            .into_iter()
            .filter(|(_, tensor)| {
                trainable_storage.contains(&(tensor.data_ptr() as usize)) == trainable
            })
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    }
}

/// `train.channels_last` means one thing everywhere: images enter the model channels-last
/// (NHWC in memory, seen as NCHW); the weights are channels-last too on CUDA (cuDNN's NHWC
/// kernels), while CPU trainers keep NCHW weights, libtorch's fast CPU path (README,
/// "Layout"). False: NCHW inputs and weights on both. Whether a model on `device` stores
/// its weights channels-last ([`Model::use_channels_last_weights`]).
pub fn channels_last_weights(channels_last: bool, device: Device) -> bool {
    channels_last && device != Device::Cpu
}

/// A 4-D NCHW tensor's values in channels-last memory (NHWC), seen as NCHW (the sizes do
/// not change; the strides do). tch has no memory-format argument; this is what
/// `contiguous(memory_format=torch.channels_last)` does.
pub fn to_channels_last(tensor: &Tensor) -> Result<Tensor, TchError> {
    tensor
        .f_permute([0, 2, 3, 1])?
        .f_contiguous()?
        .f_permute([0, 3, 1, 2])
}

/// Whether `tensor` is 4-D and laid out channels-last: dense, channels varying fastest,
/// then width, height and images (a dimension of size 1 may have any stride, as in
/// PyTorch's `is_contiguous(memory_format=torch.channels_last)`).
pub fn is_channels_last(tensor: &Tensor) -> bool {
    let (size, stride) = (tensor.size(), tensor.stride());
    if size.len() != 4 {
        return false;
    }
    let mut expected = 1;
    for dim in [1, 3, 2, 0] {
        if size[dim] != 1 && stride[dim] != expected {
            return false;
        }
        expected *= size[dim];
    }
    true
}

/// Conv 3x3 (no bias) → BatchNorm → ReLU, the small CNN's repeated block.
fn conv_block(path: nn::Path, c_in: i64, c_out: i64) -> nn::FuncT<'static> {
    let conv_config = nn::ConvConfig {
        padding: 1,
        bias: false,
        ..Default::default()
    };
    let conv = nn::conv2d(&path / "conv", c_in, c_out, 3, conv_config);
    // PyTorch's BatchNorm2d starts with weight 1 (tch's default draws it from U(0, 1)),
    // so the Python benchmark's model starts from the same kind of network.
    let norm_config = nn::BatchNormConfig {
        ws_init: nn::Init::Const(1.0),
        ..Default::default()
    };
    let norm = nn::batch_norm2d(&path / "bn", c_out, norm_config);
    nn::func_t(move |xs, train| xs.apply(&conv).apply_t(&norm, train).relu())
}

/// block(3, w) → pool → block(w, 2w) → pool → block(2w, 4w) → pool → block(4w, 8w) →
/// global average pool → linear(8w, classes).
fn small_cnn(path: &nn::Path, classes: i64, width: i64) -> nn::FuncT<'static> {
    let block1 = conv_block(path / "block1", 3, width);
    let block2 = conv_block(path / "block2", width, 2 * width);
    let block3 = conv_block(path / "block3", 2 * width, 4 * width);
    let block4 = conv_block(path / "block4", 4 * width, 8 * width);
    let fc = nn::linear(path / "fc", 8 * width, classes, Default::default());
    nn::func_t(move |xs, train| {
        xs.apply_t(&block1, train)
            .max_pool2d_default(2)
            .apply_t(&block2, train)
            .max_pool2d_default(2)
            .apply_t(&block3, train)
            .max_pool2d_default(2)
            .apply_t(&block4, train)
            .adaptive_avg_pool2d([1, 1])
            .flat_view()
            .apply(&fc)
    })
}

/// Runs `f` holding the lock every test that draws from tch's random generator takes:
/// libtorch's CPU generator is global, so a test that seeds it and expects the same
/// numbers again must not race with other tests drawing from it.
#[cfg(test)]
pub(crate) fn with_tch_rng<T>(f: impl FnOnce() -> T) -> T {
    static TCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that panicked while holding the lock leaves no state behind to protect.
    let _guard = TCH_RNG
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    const _: fn() = || {
        fn assert_send<T: Send>() {}
        assert_send::<Model>();
    };

    fn names(named: &[(String, Tensor)]) -> Vec<String> {
        named.iter().map(|(name, _)| name.clone()).collect()
    }

    #[test]
    fn kind_names_parse_serialize_and_bad_names_list_the_valid_ones() {
        for kind in ModelKind::ALL {
            assert_eq!(kind.name().parse::<ModelKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).expect("a unit variant serializes");
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(
                serde_json::from_str::<ModelKind>(&json).expect("round trip"),
                kind
            );
        }
        let err = "resnet19".parse::<ModelKind>().expect_err("not a model");
        assert!(err.contains("\"resnet19\""), "{err}");
        for kind in ModelKind::ALL {
            assert!(err.contains(kind.name()), "{err}");
        }
    }

    /// Builds `kind` from tch seed `seed` on the CPU.
    fn seeded(kind: ModelKind, classes: i64, width: i64, seed: i64) -> Model {
        with_tch_rng(|| {
            tch::manual_seed(seed);
            Model::new(kind, classes, width, Device::Cpu).expect("a CPU model builds")
        })
    }

    #[test]
    fn logits_have_one_row_per_image_and_one_column_per_class() {
        // (kind, classes, width, images, side, train)
        let cases = [
            (ModelKind::SmallCnn, 10, 4, 2, 32, true),
            (ModelKind::SmallCnn, 3, 8, 1, 16, false),
            (ModelKind::Resnet18, 7, 0, 2, 32, true),
            (ModelKind::Resnet34, 5, 0, 1, 32, false),
            (ModelKind::Resnet50, 4, 0, 1, 64, false),
        ];
        for (kind, classes, width, images, side, train) in cases {
            let model = seeded(kind, classes, width, 0);
            assert_eq!(
                (model.kind(), model.classes(), model.device()),
                (kind, classes, Device::Cpu)
            );
            let input =
                with_tch_rng(|| Tensor::randn([images, 3, side, side], (Kind::Float, Device::Cpu)));
            let logits = model.forward_t(&input, train);
            assert_eq!(logits.size(), [images, classes], "{kind}");
        }
    }

    /// The trainer hands CPU batches over channels-last (NHWC in memory): every model
    /// gives the logits and gradients it gives on the NCHW copy, to rounding.
    #[test]
    fn channels_last_input_gives_the_nchw_logits_and_gradients() {
        for kind in [ModelKind::SmallCnn, ModelKind::Resnet18] {
            let nhwc = with_tch_rng(|| {
                tch::manual_seed(3);
                Tensor::randn([4, 32, 32, 3], (Kind::Float, Device::Cpu))
            });
            let channels_last = nhwc.permute([0, 3, 1, 2]);
            let nchw = channels_last.contiguous();
            assert!(!channels_last.is_contiguous() && nchw.is_contiguous());
            let run = |input: &Tensor| {
                let model = seeded(kind, 10, 8, 0);
                let logits = model.forward_t(input, true);
                logits.square().sum(Kind::Float).backward();
                let grads: Vec<Tensor> = model
                    .parameters()
                    .iter()
                    .map(|(_, p)| p.grad().copy())
                    .collect();
                (logits.detach(), grads)
            };
            let (want_logits, want_grads) = run(&nchw);
            let (logits, grads) = run(&channels_last);
            // Rounding only: the kernels sum in another order (ResNet-18's gradients
            // differ by about 1e-4 of their largest value; a wrong layout by far more).
            let close = |a: &Tensor, b: &Tensor| {
                let scale = 1.0 + b.abs().max().double_value(&[]);
                (a - b).abs().max().double_value(&[]) <= 1e-3 * scale
            };
            assert!(close(&logits, &want_logits), "{kind}: logits");
            for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                assert!(close(g, w), "{kind}: gradient {i}");
            }
        }
    }

    /// A CUDA trainer's layout on the CPU's kernels: channels-last weights (and images)
    /// give the NCHW model's logits and gradients, to rounding; every convolution weight
    /// and its gradient are channels-last, nothing else changes layout, and the names and
    /// order of parameters and buffers stay the same.
    #[test]
    fn channels_last_weights_give_the_nchw_logits_and_gradients() {
        for kind in [ModelKind::SmallCnn, ModelKind::Resnet18] {
            let nchw = with_tch_rng(|| {
                tch::manual_seed(5);
                Tensor::randn([4, 3, 32, 32], (Kind::Float, Device::Cpu))
            });
            let channels_last = to_channels_last(&nchw).expect("permute");
            assert!(is_channels_last(&channels_last) && !is_channels_last(&nchw));
            let run = |weights_channels_last: bool, input: &Tensor| {
                let model = seeded(kind, 10, 8, 0);
                if weights_channels_last {
                    model
                        .use_channels_last_weights()
                        .expect("channels-last weights");
                }
                let logits = model.forward_t(input, true);
                logits.square().sum(Kind::Float).backward();
                (model, logits.detach())
            };
            let (want_model, want_logits) = run(false, &nchw);
            let close = |a: &Tensor, b: &Tensor| {
                let scale = 1.0 + b.abs().max().double_value(&[]);
                (a - b).abs().max().double_value(&[]) <= 1e-3 * scale
            };
            for input in [&nchw, &channels_last] {
                let (model, logits) = run(true, input);
                assert!(close(&logits, &want_logits), "{kind}: logits");
                let (params, want) = (model.parameters(), want_model.parameters());
                assert_eq!(names(&params), names(&want), "{kind}");
                assert_eq!(names(&model.buffers()), names(&want_model.buffers()));
                for ((name, p), (_, w)) in params.iter().zip(&want) {
                    assert!(p.equal(w), "{kind}: {name} changed its values");
                    assert_eq!(is_channels_last(p), p.dim() == 4, "{kind}: {name}");
                    assert_eq!(is_channels_last(&p.grad()), p.dim() == 4, "{kind}: {name}");
                    assert!(close(&p.grad(), &w.grad()), "{kind}: gradient of {name}");
                }
            }
        }
    }

    #[test]
    fn the_weights_are_channels_last_on_cuda_only_and_only_when_asked() {
        // (train.channels_last, device, channels-last weights)
        let cases = [
            (true, Device::Cpu, false),
            (false, Device::Cpu, false),
            (true, Device::Cuda(0), true),
            (false, Device::Cuda(0), false),
        ];
        for (setting, device, want) in cases {
            assert_eq!(
                channels_last_weights(setting, device),
                want,
                "{setting} {device:?}"
            );
        }
    }

    #[test]
    fn parameters_and_buffers_are_disjoint_sorted_and_stable() {
        for kind in ModelKind::ALL {
            let first = seeded(kind, 10, 4, 0);
            let second = seeded(kind, 10, 4, 1);
            let (parameters, buffers) = (names(&first.parameters()), names(&first.buffers()));
            assert!(!parameters.is_empty(), "{kind}");
            assert!(parameters.is_sorted() && buffers.is_sorted(), "{kind}");
            assert!(
                parameters.iter().all(|name| !buffers.contains(name)),
                "{kind}"
            );
            assert_eq!(
                parameters.len() + buffers.len(),
                first.var_store().len(),
                "{kind}"
            );
            assert!(
                buffers
                    .iter()
                    .all(|name| name.ends_with("running_mean") || name.ends_with("running_var")),
                "{kind}: {buffers:?}"
            );
            assert!(
                first
                    .parameters()
                    .iter()
                    .all(|(_, tensor)| tensor.requires_grad()),
                "{kind}"
            );
            assert!(
                first
                    .buffers()
                    .iter()
                    .all(|(_, tensor)| !tensor.requires_grad()),
                "{kind}"
            );
            assert_eq!(parameters, names(&second.parameters()), "{kind}");
            assert_eq!(buffers, names(&second.buffers()), "{kind}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_parameters() {
        let same = |a: &Model, b: &Model| {
            a.parameters()
                .iter()
                .zip(b.parameters())
                .all(|((_, x), (_, y))| x.equal(&y))
        };
        let first = seeded(ModelKind::SmallCnn, 10, 4, 7);
        assert!(same(&first, &seeded(ModelKind::SmallCnn, 10, 4, 7)));
        assert!(!same(&first, &seeded(ModelKind::SmallCnn, 10, 4, 8)));
    }

    #[test]
    fn small_cnn_has_the_documented_parameter_count() {
        for (classes, width) in [(10, 4), (1000, 16), (2, 1)] {
            let model = seeded(ModelKind::SmallCnn, classes, width, 0);
            let counted: i64 = model
                .parameters()
                .iter()
                .map(|(_, tensor)| tensor.numel() as i64)
                .sum();
            let w = width;
            let convs = 9 * (3 * w + w * 2 * w + 2 * w * 4 * w + 4 * w * 8 * w);
            let norms = 2 * (w + 2 * w + 4 * w + 8 * w);
            let linear = 8 * w * classes + classes;
            assert_eq!(
                counted,
                convs + norms + linear,
                "classes {classes}, width {width}"
            );
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        for (kind, classes, width) in [
            (ModelKind::SmallCnn, 0, 4),
            (ModelKind::SmallCnn, 10, 0),
            (ModelKind::Resnet18, -1, 0),
        ] {
            assert!(
                Model::new(kind, classes, width, Device::Cpu).is_err(),
                "{kind} {classes} {width}"
            );
        }
    }

    #[test]
    fn small_cnn_learns_a_separable_toy_problem() {
        use crate::train::{Sgd, SgdConfig, cross_entropy_smoothed};

        let model = seeded(ModelKind::SmallCnn, 2, 4, 3);
        // Class 0 is bright on the left half, class 1 on the right, under noise.
        let targets = Tensor::from_slice(&[0_i64, 1].repeat(8));
        let left = Tensor::cat(
            &[
                Tensor::ones([16, 3, 16, 8], (Kind::Float, Device::Cpu)),
                Tensor::zeros([16, 3, 16, 8], (Kind::Float, Device::Cpu)),
            ],
            3,
        );
        let is_right = targets.view([16, 1, 1, 1]).to_kind(Kind::Float);
        let images = &left * (1.0 - &is_right)
            + left.flip([3]) * &is_right
            + with_tch_rng(|| Tensor::randn([16, 3, 16, 16], (Kind::Float, Device::Cpu))) * 0.3;
        let config = SgdConfig {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        };
        let mut sgd = Sgd::new(model.parameters(), config);
        let mut losses = Vec::new();
        for _ in 0..15 {
            sgd.zero_grad();
            let loss = cross_entropy_smoothed(&model.forward_t(&images, true), &targets, 0.0);
            loss.backward();
            sgd.step(0.05);
            losses.push(loss.double_value(&[]));
        }
        let last = losses[losses.len() - 1];
        assert!(last < 0.5 * losses[0], "loss did not fall: {losses:?}");
    }
}
