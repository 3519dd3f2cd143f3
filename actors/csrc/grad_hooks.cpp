// Gradient-ready hooks for imgrun's overlapped allreduce (actors/src/train/overlap.rs).
//
// libtorch calls a parameter's post-accumulate-grad hook once backward has written the
// parameter's `.grad`. The hook here hands the gradient, as a new tensor handle, to a
// Rust callback with the parameter's index, so that Rust can put it in its bucket while
// backward goes on. The callback's context is Rust's; the hook releases it through
// `release` when libtorch drops the hook (when another replaces it, or the tensor dies).

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <exception>
#include <memory>

extern "C" {
typedef void (*imgrun_grad_ready)(void *context, size_t index, at::Tensor *grad);
typedef void (*imgrun_release)(void *context);
}

namespace {

class GradReady final : public torch::autograd::PostAccumulateGradHook {
public:
  GradReady(imgrun_grad_ready ready, imgrun_release release, void *context, size_t index)
      : ready_(ready), release_(release), context_(context), index_(index) {}

  GradReady(const GradReady &) = delete;
  GradReady &operator=(const GradReady &) = delete;

  ~GradReady() override { release_(context_); }

  const void *context() const { return context_; }

  void operator()(const torch::autograd::Variable &parameter) override {
    const at::Tensor &grad = parameter.grad();
    // The callback owns the handle (Rust's `Tensor::from_ptr` frees it).
    ready_(context_, index_, grad.defined() ? new at::Tensor(grad) : nullptr);
  }

private:
  imgrun_grad_ready ready_;
  imgrun_release release_;
  void *context_;
  size_t index_;
};

} // namespace

extern "C" {

// Sets `parameter`'s post-accumulate-grad hook (replacing any other). From the call on,
// the hook owns `context`, whatever the outcome: on failure it is released here.
// Returns 0, or 1 when libtorch refused (the parameter is not a leaf that requires grad).
int imgrun_set_grad_ready_hook(const at::Tensor *parameter, imgrun_grad_ready ready,
                               imgrun_release release, void *context, size_t index) {
  std::unique_ptr<GradReady> hook;
  try {
    hook = std::make_unique<GradReady>(ready, release, context, index);
  } catch (...) {
    release(context);
    return 1;
  }
  try {
    if (!parameter->defined() || !parameter->requires_grad() || !parameter->is_leaf()) {
      return 1;
    }
    torch::autograd::impl::set_post_acc_grad_hooks(*parameter, std::move(hook));
    return 0;
  } catch (...) {
    return 1;
  }
}

// Removes `parameter`'s post-accumulate-grad hook (releasing its context) if it is the
// one set with `context`; another's stays.
void imgrun_clear_grad_ready_hook(const at::Tensor *parameter, const void *context) {
  try {
    if (!parameter->defined()) {
      return;
    }
    auto &hook = torch::autograd::impl::post_acc_grad_hooks(*parameter);
    auto *ours = dynamic_cast<GradReady *>(hook.get());
    if (ours != nullptr && ours->context() == context) {
      hook.reset();
    }
  } catch (...) {
  }
}
}
