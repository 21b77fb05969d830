// What the kernels need of torch, without <torch/extension.h>: that header pulls in all of libtorch's C++ API
// (autograd, nn, optim) and costs ~26 s of compiling per kernel on 2 cores; these cost ~7 s.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {  // the names the kernels use, as <torch/types.h> defines them
using at::Tensor;
using at::empty;
using at::empty_like;
using at::full;
using at::zeros;
using namespace c10;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch
