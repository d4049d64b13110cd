// executor: runs a fused graph (static or symbolic sizes) as one call from
// Python.  The graph arrives once, as the program that
// mindiesd/compilation/runtime/lowering.py lowers it into, read here field by
// field by name: per instruction the operator (name and overload), where each
// of its schema arguments comes from (operands: a value slot, a list of slots,
// or a constant converted once to the schema's type), the slots its returns go
// to and the slots released after it; Python's arithmetic on a graph's
// symbolic sizes is an instruction of its own.  A run fills the input slots, calls each
// operator through the dispatcher's boxed entry (what a Python call of the op
// reaches, without parsing Python arguments or wrapping every result in a
// Python object) and returns the output values.  A fused op with a C++ CPU
// kernel calls that kernel's entry point straight, as the generated Python
// runner does, through the entry its source registered under the op's name
// (entries.h; this file names no fused op); where the entry declines the form
// (nullopt) or throws, the op's own boxed call runs, which raises its own
// error.
//
// Views and out= writes run below the autograd and view-tracking layers
// (AutoDispatchBelowADInplaceOrView) only where that changes nothing: grad
// mode is off and every write in place of the graph goes into a buffer the
// graph allocated itself (the builder checks the second).  There, a view op
// (view, permute, split, ...) whose input has the sizes and strides it had on
// the op's first call makes its results as that call did, without a call: the
// sizes, strides and storage offset of a view are a function of its input's
// sizes and strides and of the op's constant arguments.  A view whose result
// reaches a graph output ("tracked") always runs above the view-tracking layer
// and is never memoised: the caller sees its base and version counter, as in
// eager.  The GIL is released
// while the operators run; kernels written in Python take it back themselves.

#include "entries.h"
#include "kernels.h"

#include <ATen/ScalarOps.h>
#include <c10/util/SmallVector.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace mindiesd_cpu {
namespace {

using at::Tensor;
using c10::IValue;

// Where an argument's value comes from.
struct Arg {
  // kTake: a slot's last read, moved rather than copied into the boxed call's stack; kScalar: a slot holding a
  // number (a symbolic size) where the schema takes a tensor; kInts: a list of ints, each a slot or a constant
  enum Kind : int8_t { kSlot, kTake, kConst, kTensors, kOptionalTensors, kScalar, kInts } kind = kConst;
  int64_t slot = -1;           // kSlot / kTake / kScalar
  IValue value;                // kConst
  std::vector<int64_t> slots;  // kTensors / kOptionalTensors (-1: None); kInts: the slot of each element or -1
  std::vector<int64_t> ints;   // kInts: the constant elements
};

// Python's operators on a graph's sizes (compilation/runtime/lowering.py's ARITHMETIC).
enum class Arithmetic : int {
  kNone = -1, kAdd, kSub, kMul, kFloorDiv, kMod, kTrueDiv, kNeg, kPow, kMax, kMin, kFloat, kInt,
  kEq, kNe, kLt, kLe, kGt, kGe, kSum,
};

Arithmetic arithmetic_named(const std::string& name) {
  static const std::pair<const char*, Arithmetic> kNames[] = {
      {"add", Arithmetic::kAdd}, {"sub", Arithmetic::kSub}, {"mul", Arithmetic::kMul},
      {"floordiv", Arithmetic::kFloorDiv}, {"mod", Arithmetic::kMod}, {"truediv", Arithmetic::kTrueDiv},
      {"neg", Arithmetic::kNeg}, {"pow", Arithmetic::kPow}, {"max", Arithmetic::kMax}, {"min", Arithmetic::kMin},
      {"float", Arithmetic::kFloat}, {"int", Arithmetic::kInt}, {"eq", Arithmetic::kEq}, {"ne", Arithmetic::kNe},
      {"lt", Arithmetic::kLt}, {"le", Arithmetic::kLe}, {"gt", Arithmetic::kGt}, {"ge", Arithmetic::kGe},
      {"sum", Arithmetic::kSum}};
  for (const auto& [known, op] : kNames) {
    if (name == known) {
      return op;
    }
  }
  throw std::invalid_argument("no arithmetic named " + name);
}

// Python's floor division and modulo of ints (rounding toward negative infinity).
int64_t floor_div(int64_t a, int64_t b) {
  if (b == 0) {
    throw std::domain_error("integer division or modulo by zero");
  }
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

int64_t python_mod(int64_t a, int64_t b) {
  return a - floor_div(a, b) * b;
}

IValue compute(Arithmetic op, const IValue& a, const IValue& b) {
  const bool ints = (a.isInt() || a.isBool()) && (b.isNone() || b.isInt() || b.isBool());
  const auto as_int = [](const IValue& v) { return v.isBool() ? static_cast<int64_t>(v.toBool()) : v.toInt(); };
  const auto as_double = [&](const IValue& v) { return v.isDouble() ? v.toDouble() : static_cast<double>(as_int(v)); };
  switch (op) {
    case Arithmetic::kNeg:
      return a.isDouble() ? IValue(-a.toDouble()) : IValue(-as_int(a));
    case Arithmetic::kFloat:
      return IValue(as_double(a));
    case Arithmetic::kInt:
      return IValue(a.isDouble() ? static_cast<int64_t>(a.toDouble()) : as_int(a));
    case Arithmetic::kTrueDiv:
      return IValue(as_double(a) / as_double(b));
    case Arithmetic::kEq: return IValue(ints ? as_int(a) == as_int(b) : as_double(a) == as_double(b));
    case Arithmetic::kNe: return IValue(ints ? as_int(a) != as_int(b) : as_double(a) != as_double(b));
    case Arithmetic::kLt: return IValue(ints ? as_int(a) < as_int(b) : as_double(a) < as_double(b));
    case Arithmetic::kLe: return IValue(ints ? as_int(a) <= as_int(b) : as_double(a) <= as_double(b));
    case Arithmetic::kGt: return IValue(ints ? as_int(a) > as_int(b) : as_double(a) > as_double(b));
    case Arithmetic::kGe: return IValue(ints ? as_int(a) >= as_int(b) : as_double(a) >= as_double(b));
    default:
      break;
  }
  if (ints) {
    const int64_t x = as_int(a), y = as_int(b);
    switch (op) {
      case Arithmetic::kAdd: return IValue(x + y);
      case Arithmetic::kSub: return IValue(x - y);
      case Arithmetic::kMul: return IValue(x * y);
      case Arithmetic::kFloorDiv: return IValue(floor_div(x, y));
      case Arithmetic::kMod: return IValue(python_mod(x, y));
      case Arithmetic::kMax: return IValue(std::max(x, y));
      case Arithmetic::kMin: return IValue(std::min(x, y));
      case Arithmetic::kPow:
        if (y >= 0) {
          int64_t result = 1;
          for (int64_t i = 0; i < y; ++i) {
            result *= x;
          }
          return IValue(result);
        }
        return IValue(std::pow(static_cast<double>(x), static_cast<double>(y)));
      default:
        break;
    }
  } else {
    const double x = as_double(a), y = as_double(b);
    switch (op) {
      case Arithmetic::kAdd: return IValue(x + y);
      case Arithmetic::kSub: return IValue(x - y);
      case Arithmetic::kMul: return IValue(x * y);
      case Arithmetic::kFloorDiv: return IValue(std::floor(x / y));
      case Arithmetic::kMod: return IValue(x - std::floor(x / y) * y);
      case Arithmetic::kMax: return IValue(std::max(x, y));
      case Arithmetic::kMin: return IValue(std::min(x, y));
      case Arithmetic::kPow: return IValue(std::pow(x, y));
      default:
        break;
    }
  }
  throw std::logic_error("unknown arithmetic");
}

// A number as the 0-dim "wrapped number" tensor that Python's argument parser makes of it, which type promotion
// treats as a scalar.
Tensor wrapped_number(const IValue& number) {
  Tensor wrapped;
  if (number.isBool()) {
    wrapped = at::scalar_to_tensor(c10::Scalar(number.toBool()));
  } else if (number.isInt()) {
    wrapped = at::scalar_to_tensor(c10::Scalar(number.toInt()));
  } else {
    wrapped = at::scalar_to_tensor(c10::Scalar(number.toDouble()));
  }
  wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
  return wrapped;
}

// The registered entry (entries.h) named ``name``; throws std::invalid_argument where there is none.
EntryFn entry_named(const std::string& name) {
  const EntryFn entry = find_entry(name);
  if (entry == nullptr) {
    throw std::invalid_argument("no C++ entry point named " + name);
  }
  return entry;
}

// The ops whose results are views of their first argument, with sizes, strides and an offset from its own that
// depend only on its sizes and strides and the op's constant arguments (as_strided, which sets an absolute
// offset, and reshape, which may copy, are not among them).
bool is_geometric_view(const std::string& name, const std::string& overload) {
  static const std::pair<const char*, const char*> kViews[] = {
      {"aten::view", ""}, {"aten::_unsafe_view", ""}, {"aten::permute", ""}, {"aten::unsqueeze", ""},
      {"aten::squeeze", "dim"}, {"aten::squeeze", "dims"}, {"aten::squeeze", ""}, {"aten::select", "int"},
      {"aten::slice", "Tensor"}, {"aten::split", "Tensor"}, {"aten::split_with_sizes", ""}, {"aten::t", ""},
      {"aten::transpose", "int"}, {"aten::expand", ""}, {"aten::narrow", ""}, {"aten::unbind", "int"},
      {"aten::alias", ""}, {"aten::unflatten", "int"}};
  for (const auto& [known, known_overload] : kViews) {
    if (name == known && overload == known_overload) {
      return true;
    }
  }
  return false;
}

// A view's geometry: sizes, strides, and its storage offset less its input's.
struct Geometry {
  std::vector<int64_t> sizes, strides;
  int64_t delta = 0;
};

// What a view op made of an input of one geometry, with one set of int arguments (a graph's symbolic sizes), on
// the first call that met them (filled once; read without a lock after).
struct ViewMemoEntry {
  std::atomic<int> state{0};  // 0: empty, 1: being filled, 2: ready, 3: not memoised
  std::vector<int64_t> sizes, strides;  // the input's
  std::vector<int64_t> ints;  // the int arguments that are values, in order
  c10::DispatchKeySet keys;
  bool list = false;  // the op returns a list of views
  std::vector<Geometry> results;
};

// A view op's memoised results for up to ``count`` input geometries (the program's ``view_geometries``: the sizes
// a graph with symbolic sizes serves most; later ones run the op).
struct ViewMemo {
  explicit ViewMemo(size_t n) : entries(new ViewMemoEntry[n]), count(n) {}
  std::unique_ptr<ViewMemoEntry[]> entries;
  size_t count;
  const ViewMemoEntry* begin() const { return entries.get(); }
  const ViewMemoEntry* end() const { return entries.get() + count; }
  ViewMemoEntry* begin() { return entries.get(); }
  ViewMemoEntry* end() { return entries.get() + count; }
};

using ViewInts = c10::SmallVector<int64_t, 8>;

Tensor view_with(const Tensor& base, const Geometry& geometry) {
  return alias_view(base, geometry.sizes, geometry.strides, base.storage_offset() + geometry.delta);
}

struct Instruction {
  std::optional<c10::OperatorHandle> op;
  std::vector<Arg> args;                 // one per schema argument, in order
  std::vector<int64_t> outs;             // one per return (-1: not kept)
  std::vector<std::pair<int64_t, int64_t>> unpack;  // (element, slot) of a list returned first
  std::vector<int64_t> frees;            // slots released after this instruction
  EntryFn entry = nullptr;               // the straight call, where there is one
  std::vector<Arg> direct;               // its arguments
  std::optional<at::ScalarType> out_dtype;
  std::vector<int64_t> order, inverse;   // a result not row-major: the adapter's permutations
  std::vector<int64_t> moved;            // direct arguments permuted into the result's order
  std::unique_ptr<ViewMemo> view;        // a view op whose first argument is a value: its first call's results
  bool tracked = false;                  // a view reaching an output: made above the view-tracking layer
  Arithmetic arithmetic = Arithmetic::kNone;  // a Python operator on numbers, not an operator call
};

const Tensor& tensor_at(const std::vector<IValue>& slots, int64_t slot) {
  return slots[slot].toTensor();
}

class Program {
 public:
  // ``program``: a lowering.Program (slot_count, inputs, cpp_instructions, output_slots, output_is_list,
  // below_autograd), read by field name.
  Program(const py::object& program, int64_t view_geometries)
      : slot_count_(py::cast<int64_t>(program.attr("slot_count"))),
        inputs_(py::cast<std::vector<int64_t>>(program.attr("inputs"))),
        output_is_list_(py::cast<bool>(program.attr("output_is_list"))),
        below_autograd_allowed_(py::cast<bool>(program.attr("below_autograd"))),
        view_geometries_(view_geometries < 0 ? 0 : static_cast<size_t>(view_geometries)) {
    for (const auto& item : program.attr("cpp_instructions")) {
      program_.push_back(instruction(py::reinterpret_borrow<py::object>(item)));
    }
    outputs_ = py::cast<std::vector<int64_t>>(program.attr("output_slots"));
  }

  void set_selection(std::vector<int64_t> selection) {
    selection_ = std::move(selection);
  }

  const std::vector<int64_t>& selection() const {
    return selection_;
  }

  int64_t direct_calls() const {
    return direct_calls_.load(std::memory_order_relaxed);
  }

  int64_t memoised_views() const {
    return memoised_views_.load(std::memory_order_relaxed);
  }

  // The bytes the view memo holds: every view op's entries, and the sizes, strides and results of those filled.
  int64_t view_memo_bytes() const {
    size_t bytes = 0;
    for (const Instruction& in : program_) {
      if (!in.view) {
        continue;
      }
      bytes += sizeof(ViewMemo) + in.view->count * sizeof(ViewMemoEntry);
      for (const ViewMemoEntry& entry : *in.view) {
        if (entry.state.load(std::memory_order_acquire) != 2) {
          continue;
        }
        bytes += (entry.sizes.capacity() + entry.strides.capacity() + entry.ints.capacity()) * sizeof(int64_t);
        bytes += entry.results.capacity() * sizeof(Geometry);
        for (const Geometry& geometry : entry.results) {
          bytes += (geometry.sizes.capacity() + geometry.strides.capacity()) * sizeof(int64_t);
        }
      }
    }
    return static_cast<int64_t>(bytes);
  }

  int64_t size() const {
    return static_cast<int64_t>(program_.size());
  }

  py::object run(const py::tuple& args, bool no_grad) const {
    if (static_cast<int64_t>(args.size()) != static_cast<int64_t>(inputs_.size())) {
      throw std::invalid_argument("the executor's program takes " + std::to_string(inputs_.size()) +
                                  " inputs, got " + std::to_string(args.size()));
    }
    std::vector<IValue> slots(slot_count_);
    for (size_t i = 0; i < inputs_.size(); ++i) {
      slots[inputs_[i]] = input(args[i]);
    }
    return execute_all(slots, no_grad);
  }

  // The inputs chosen as a frozen graph's bound call does (freezing.py): the folded constants first, then the
  // arguments at the selected positions; with grad mode off where ``no_grad`` (an inference call).
  py::object run_selected(const py::tuple& folded, const py::tuple& args, bool no_grad) const {
    const std::vector<int64_t>& selection = selection_;
    const size_t count = folded.size() + selection.size();
    if (count != inputs_.size()) {
      throw std::invalid_argument("the executor's program takes " + std::to_string(inputs_.size()) +
                                  " inputs, got " + std::to_string(count));
    }
    std::vector<IValue> slots(slot_count_);
    for (size_t i = 0; i < folded.size(); ++i) {
      slots[inputs_[i]] = input(folded[i]);
    }
    const int64_t available = static_cast<int64_t>(args.size());
    for (size_t i = 0; i < selection.size(); ++i) {
      const int64_t index = selection[i];
      if (index < 0 || index >= available) {
        throw std::out_of_range("selected argument " + std::to_string(index) + " of " + std::to_string(available));
      }
      slots[inputs_[folded.size() + i]] = input(args[index]);
    }
    return execute_all(slots, no_grad);
  }

 private:
  py::object execute_all(std::vector<IValue>& slots, bool no_grad) const {
    {
      py::gil_scoped_release no_gil;
      std::optional<at::NoGradGuard> grad_off;
      if (no_grad) {
        grad_off.emplace();
      }
      const bool below = below_autograd_allowed_ && !at::GradMode::is_enabled();
      // views made without a call only where no dispatch mode is there to see every op (a device-graph capture's
      // recording, a FakeTensorMode)
      const bool fast_views = below && c10::impl::TorchDispatchModeTLS::stack_len() == 0;
      const c10::impl::LocalDispatchKeySet above = c10::impl::tls_local_dispatch_key_set();
      std::optional<at::AutoDispatchBelowADInplaceOrView> guard;
      if (below) {
        guard.emplace();
      }
      torch::jit::Stack stack;
      stack.reserve(16);
      for (const Instruction& in : program_) {
        if (in.tracked && below) {
          c10::impl::ForceDispatchKeyGuard tracked(above);
          execute(in, slots, stack, false);
        } else {
          execute(in, slots, stack, fast_views);
        }
      }
    }
    py::tuple result(outputs_.size());
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const int64_t slot = outputs_[i];
      result[i] = slot < 0 ? py::none() : torch::jit::toPyObject(slots[slot]);
    }
    if (output_is_list_) {
      return py::list(result);
    }
    return std::move(result);
  }

  // A graph input: a tensor, or a number, bool or None of a graph with static shapes.
  static IValue input(const py::handle& obj) {
    PyObject* ptr = obj.ptr();
    if (THPVariable_Check(ptr)) {
      return THPVariable_Unpack(ptr);
    }
    if (obj.is_none()) {
      return IValue();
    }
    if (PyBool_Check(ptr)) {
      return py::cast<bool>(obj);
    }
    if (PyLong_Check(ptr)) {
      return py::cast<int64_t>(obj);
    }
    if (PyFloat_Check(ptr)) {
      return py::cast<double>(obj);
    }
    throw std::invalid_argument("the executor takes tensors, numbers, bools and None as inputs");
  }

  // one lowering.Operand (kind, value) for an argument of schema type ``type``
  static Arg argument(const py::handle& operand, const c10::TypePtr& type) {
    const auto kind = py::cast<std::string>(operand.attr("kind"));
    const py::object value = operand.attr("value");
    Arg arg;
    if (kind == "slot" || kind == "take") {
      arg.kind = kind == "slot" ? Arg::kSlot : Arg::kTake;
      arg.slot = py::cast<int64_t>(value);
    } else if (kind == "const") {
      arg.kind = Arg::kConst;
      arg.value = torch::jit::toIValue(value, type);
    } else if (kind == "number") {
      // a Python number where the schema takes a tensor: the 0-dim "wrapped number" that Python's argument
      // parser makes of it, which type promotion treats as a scalar
      arg.kind = Arg::kConst;
      if (PyBool_Check(value.ptr())) {
        arg.value = wrapped_number(IValue(py::cast<bool>(value)));
      } else if (PyLong_Check(value.ptr())) {
        arg.value = wrapped_number(IValue(py::cast<int64_t>(value)));
      } else {
        arg.value = wrapped_number(IValue(py::cast<double>(value)));
      }
    } else if (kind == "scalar") {
      arg.kind = Arg::kScalar;
      arg.slot = py::cast<int64_t>(value);
    } else if (kind == "ints") {  // pairs (is a slot, slot or int)
      arg.kind = Arg::kInts;
      for (const auto& item : value) {
        const auto pair = py::reinterpret_borrow<py::tuple>(item);
        const bool is_slot = py::cast<bool>(pair[0]);
        arg.slots.push_back(is_slot ? py::cast<int64_t>(pair[1]) : -1);
        arg.ints.push_back(is_slot ? 0 : py::cast<int64_t>(pair[1]));
      }
    } else if (kind == "tensors" || kind == "optional_tensors") {
      arg.kind = kind == "tensors" ? Arg::kTensors : Arg::kOptionalTensors;
      arg.slots = py::cast<std::vector<int64_t>>(value);
    } else {
      throw std::invalid_argument("unknown operand kind " + kind);
    }
    return arg;
  }

  // one lowering.Instruction of kind "call" or "arithmetic"
  Instruction instruction(const py::object& spec) const {
    Instruction in;
    const auto name = py::cast<std::string>(spec.attr("name"));
    const auto overload = py::cast<std::string>(spec.attr("overload"));
    const py::object operands = spec.attr("operands");
    in.outs = py::cast<std::vector<int64_t>>(spec.attr("outs"));
    in.frees = py::cast<std::vector<int64_t>>(spec.attr("slot_frees"));
    if (name == "mindiesd::arithmetic") {  // operands: slots and constants; one result
      in.arithmetic = arithmetic_named(overload);
      for (const auto& operand : operands) {
        Arg arg;
        const auto kind = py::cast<std::string>(operand.attr("kind"));
        if (kind == "slot" || kind == "take") {
          arg.kind = Arg::kSlot;
          arg.slot = py::cast<int64_t>(operand.attr("value"));
        } else if (kind == "const") {
          arg.value = torch::jit::toIValue(operand.attr("value"), c10::NumberType::get());
        } else {
          throw std::invalid_argument("arithmetic " + overload + ": an operand of kind " + kind);
        }
        in.args.push_back(std::move(arg));
      }
      if (in.args.empty() || (in.args.size() > 2 && in.arithmetic != Arithmetic::kSum) || in.outs.size() != 1) {
        throw std::invalid_argument("arithmetic " + overload + ": one or two operands (sum: any), one result");
      }
      return in;
    }
    in.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = in.op->schema();
    const auto& arguments = schema.arguments();
    if (py::len(operands) != arguments.size()) {
      throw std::invalid_argument(name + "." + overload + ": " + std::to_string(py::len(operands)) +
                                  " operands for a schema of " + std::to_string(arguments.size()) + " arguments");
    }
    size_t i = 0;
    for (const auto& operand : operands) {
      if (py::cast<std::string>(operand.attr("kind")) == "default") {
        if (!arguments[i].default_value().has_value()) {
          throw std::invalid_argument(name + ": no default for " + arguments[i].name());
        }
        Arg arg;
        arg.value = *arguments[i].default_value();
        in.args.push_back(std::move(arg));
      } else {
        in.args.push_back(argument(operand, arguments[i].type()));
      }
      ++i;
    }
    in.tracked = py::cast<bool>(spec.attr("tracked"));
    if (!in.tracked && is_geometric_view(name, overload) && !in.args.empty() &&
        (in.args[0].kind == Arg::kSlot || in.args[0].kind == Arg::kTake) &&
        std::all_of(in.args.begin() + 1, in.args.end(), [](const Arg& arg) {
          return arg.kind == Arg::kConst || arg.kind == Arg::kInts || arg.kind == Arg::kSlot || arg.kind == Arg::kTake;
        })) {
      if (view_geometries_ > 0) {  // its other arguments are constants or ints: memoised per their values
        in.view = std::make_unique<ViewMemo>(view_geometries_);
      }
    }
    if (in.outs.size() != schema.returns().size()) {
      throw std::invalid_argument(name + ": return slots do not match the schema");
    }
    in.unpack = py::cast<std::vector<std::pair<int64_t, int64_t>>>(spec.attr("elements"));
    const py::object direct = spec.attr("direct");
    if (!direct.is_none()) {  // a lowering.DirectCall: entry, operands, out_dtype, order, moved
      in.entry = entry_named(py::cast<std::string>(direct.attr("entry")));
      // the entry takes the schema's leading arguments, in order
      const py::object picks = direct.attr("operands");
      if (py::len(picks) > arguments.size()) {
        throw std::invalid_argument(name + ": more entry arguments than schema arguments");
      }
      size_t position = 0;
      for (const auto& operand : picks) {
        in.direct.push_back(argument(operand, arguments[position++].type()));
      }
      const py::object out_dtype = direct.attr("out_dtype");
      if (!out_dtype.is_none()) {
        in.out_dtype = torch::jit::toIValue(out_dtype, c10::IntType::get()).toScalarType();
      }
      const py::object order = direct.attr("order");
      if (!order.is_none()) {
        in.order = py::cast<std::vector<int64_t>>(order);
        in.inverse.assign(in.order.size(), 0);
        for (size_t k = 0; k < in.order.size(); ++k) {
          in.inverse[in.order[k]] = static_cast<int64_t>(k);
        }
        in.moved = py::cast<std::vector<int64_t>>(direct.attr("moved"));
      }
    }
    return in;
  }

  static IValue value_of(const Arg& arg, const std::vector<IValue>& slots) {
    switch (arg.kind) {
      case Arg::kSlot:
      case Arg::kTake:
        return slots[arg.slot];
      case Arg::kConst:
        return arg.value;
      case Arg::kScalar: {
        const IValue& value = slots[arg.slot];
        return value.isTensor() ? value : IValue(wrapped_number(value));
      }
      case Arg::kInts: {
        c10::List<int64_t> list;
        list.reserve(arg.ints.size());
        for (size_t i = 0; i < arg.ints.size(); ++i) {
          list.push_back(arg.slots[i] < 0 ? arg.ints[i] : slots[arg.slots[i]].toInt());
        }
        return list;
      }
      case Arg::kTensors: {
        c10::List<Tensor> list;
        list.reserve(arg.slots.size());
        for (const int64_t slot : arg.slots) {
          list.push_back(tensor_at(slots, slot));
        }
        return list;
      }
      case Arg::kOptionalTensors: {
        c10::List<std::optional<Tensor>> list;
        list.reserve(arg.slots.size());
        for (const int64_t slot : arg.slots) {
          list.push_back(slot < 0 ? std::optional<Tensor>() : std::optional<Tensor>(tensor_at(slots, slot)));
        }
        return list;
      }
    }
    return IValue();
  }

  // The straight call of a fused op's entry point; nullopt where it declines the form or throws.
  static std::optional<Tensor> call_entry(const Instruction& in, std::vector<IValue>& values) {
    if (!in.order.empty()) {
      const int64_t rank = static_cast<int64_t>(in.order.size());
      for (const int64_t index : in.moved) {
        if (index < static_cast<int64_t>(values.size()) && values[index].isTensor()) {
          Tensor value = values[index].toTensor();
          while (value.dim() < rank) {
            value = value.unsqueeze(0);
          }
          values[index] = value.permute(in.order);
        }
      }
    }
    std::optional<Tensor> result;
    try {
      result = in.entry(EntryArgs(values, in.out_dtype));
    } catch (const std::exception&) {
      return std::nullopt;  // the op's own path runs, and raises its own error where there is one
    }
    if (result.has_value() && !in.order.empty()) {
      result = result->permute(in.inverse);
    }
    return result;
  }

  // The values of a view op's int arguments after its input (the elements of int lists that are values, ints held
  // in slots), in order; false where one is not an int.
  static bool view_ints(const Instruction& in, const std::vector<IValue>& slots, ViewInts& ints) {
    for (size_t i = 1; i < in.args.size(); ++i) {
      const Arg& arg = in.args[i];
      if (arg.kind == Arg::kInts) {
        for (size_t j = 0; j < arg.slots.size(); ++j) {
          if (arg.slots[j] >= 0) {
            const IValue& value = slots[arg.slots[j]];
            if (!value.isInt()) {
              return false;
            }
            ints.push_back(value.toInt());
          }
        }
      } else if (arg.kind == Arg::kSlot || arg.kind == Arg::kTake) {
        const IValue& value = slots[arg.slot];
        if (!value.isInt()) {
          return false;
        }
        ints.push_back(value.toInt());
      }
    }
    return true;
  }

  // The results of a view op made as the first call on an input of this geometry with these int arguments made
  // them; false where no call has met them yet.
  bool memoised_view(const Instruction& in, std::vector<IValue>& slots, const ViewInts& ints) const {
    const Arg& source = in.args[0];
    const IValue& value = slots[source.slot];
    if (!value.isTensor()) {
      return false;
    }
    const Tensor& base = value.toTensor();
    if (!plain_impl(base)) {
      return false;
    }
    const ViewMemoEntry* found = nullptr;
    for (const ViewMemoEntry& entry : *in.view) {
      const int state = entry.state.load(std::memory_order_acquire);
      if (state == 0) {
        break;  // entries fill in order: none after an empty one
      }
      if (state == 2 && base.sizes() == at::IntArrayRef(entry.sizes) &&
          base.strides() == at::IntArrayRef(entry.strides) && at::IntArrayRef(ints) == at::IntArrayRef(entry.ints) &&
          base.key_set() == entry.keys) {
        found = &entry;
        break;
      }
    }
    if (found == nullptr) {
      return false;
    }
    const ViewMemoEntry& memo = *found;
    if (memo.list) {
      c10::List<Tensor> list;
      list.reserve(memo.results.size());
      for (const Geometry& geometry : memo.results) {
        list.push_back(view_with(base, geometry));
      }
      for (const auto& [element, slot] : in.unpack) {
        slots[slot] = list.get(element);
      }
      if (in.outs[0] >= 0) {
        slots[in.outs[0]] = std::move(list);
      }
    } else if (in.outs[0] >= 0) {
      slots[in.outs[0]] = view_with(base, memo.results[0]);
    }
    if (source.kind == Arg::kTake) {
      slots[source.slot] = IValue();
    }
    memoised_views_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Keeps, in the first empty entry, what a view op's call made of its input ``base`` (its geometry before the
  // call) with int arguments ``ints`` where the results are plain views of it; marks the entry not memoised
  // otherwise.
  static void remember_view(const Instruction& in, const Tensor& base, std::vector<int64_t> sizes,
                            std::vector<int64_t> strides, int64_t offset, const ViewInts& ints,
                            const IValue& returned) {
    ViewMemoEntry* claimed = nullptr;
    for (ViewMemoEntry& entry : *in.view) {
      int expected = 0;
      if (entry.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
        claimed = &entry;
        break;
      }
    }
    if (claimed == nullptr) {
      return;
    }
    ViewMemoEntry& memo = *claimed;
    memo.ints.assign(ints.begin(), ints.end());
    bool ok = true;
    std::vector<Geometry> results;
    auto keep = [&](const IValue& item) {
      if (!ok || !item.isTensor()) {
        ok = false;
        return;
      }
      const Tensor& view = item.toTensor();
      if (!plain_impl(view) || !view.storage().is_alias_of(base.storage()) || view.dtype() != base.dtype() ||
          view.key_set() != base.key_set()) {
        ok = false;
        return;
      }
      results.push_back({view.sizes().vec(), view.strides().vec(), view.storage_offset() - offset});
    };
    if (returned.isTensorList()) {
      memo.list = true;
      for (const IValue& item : returned.toListRef()) {
        keep(item);
      }
    } else {
      keep(returned);
    }
    if (ok) {
      memo.sizes = std::move(sizes);
      memo.strides = std::move(strides);
      memo.keys = base.key_set();
      memo.results = std::move(results);
    }
    memo.state.store(ok ? 2 : 3, std::memory_order_release);
  }

  void execute(const Instruction& in, std::vector<IValue>& slots, torch::jit::Stack& stack, bool fast_views) const {
    if (in.arithmetic == Arithmetic::kSum) {
      IValue total = value_of(in.args[0], slots);
      for (size_t i = 1; i < in.args.size(); ++i) {
        total = compute(Arithmetic::kAdd, total, value_of(in.args[i], slots));
      }
      slots[in.outs[0]] = std::move(total);
      for (const int64_t slot : in.frees) {
        slots[slot] = IValue();
      }
      return;
    }
    if (in.arithmetic != Arithmetic::kNone) {
      const IValue a = value_of(in.args[0], slots);
      const IValue b = in.args.size() > 1 ? value_of(in.args[1], slots) : IValue();
      slots[in.outs[0]] = compute(in.arithmetic, a, b);
      for (const int64_t slot : in.frees) {
        slots[slot] = IValue();
      }
      return;
    }
    ViewInts ints;
    const bool memoisable = in.view && fast_views && view_ints(in, slots, ints);
    if (memoisable && memoised_view(in, slots, ints)) {
      for (const int64_t slot : in.frees) {
        slots[slot] = IValue();
      }
      return;
    }
    bool done = false;
    if (in.entry != nullptr) {
      stack.clear();  // the boxed call's stack, reused for the entry's arguments
      for (const Arg& arg : in.direct) {
        stack.push_back(value_of(arg, slots));
      }
      std::optional<Tensor> result = call_entry(in, stack);
      stack.clear();
      if (result.has_value()) {
        direct_calls_.fetch_add(1, std::memory_order_relaxed);
        if (in.outs[0] >= 0) {
          slots[in.outs[0]] = std::move(*result);
        }
        done = true;
      }
    }
    if (!done) {
      stack.clear();
      // a view op's first call below the view-tracking layer: its input's geometry, to keep what it makes of it
      std::optional<Tensor> view_base;
      std::vector<int64_t> base_sizes, base_strides;
      int64_t base_offset = 0;
      if (memoisable && in.view->entries[in.view->count - 1].state.load(std::memory_order_acquire) == 0 &&
          slots[in.args[0].slot].isTensor() && plain_impl(slots[in.args[0].slot].toTensor())) {
        view_base = slots[in.args[0].slot].toTensor();
        base_sizes = view_base->sizes().vec();
        base_strides = view_base->strides().vec();
        base_offset = view_base->storage_offset();
      }
      for (const Arg& arg : in.args) {
        if (arg.kind == Arg::kSlot) {
          stack.push_back(slots[arg.slot]);
        } else if (arg.kind == Arg::kTake) {
          stack.push_back(std::move(slots[arg.slot]));
        } else if (arg.kind == Arg::kConst) {
          stack.push_back(arg.value);
        } else {
          stack.push_back(value_of(arg, slots));
        }
      }
      in.op->callBoxed(stack);
      if (view_base.has_value() && !stack.empty()) {
        remember_view(in, *view_base, std::move(base_sizes), std::move(base_strides), base_offset, ints, stack[0]);
        view_base.reset();
      }
      if (!in.unpack.empty()) {
        const auto list = stack[0].toListRef();
        for (const auto& [element, slot] : in.unpack) {
          slots[slot] = list[element];
        }
      }
      for (size_t i = 0; i < in.outs.size() && i < stack.size(); ++i) {
        if (in.outs[i] >= 0) {
          slots[in.outs[i]] = std::move(stack[i]);
        }
      }
      stack.clear();
    } else if (!in.unpack.empty()) {
      throw std::logic_error("a straight call returns one tensor");
    }
    for (const int64_t slot : in.frees) {
      slots[slot] = IValue();
    }
  }

  int64_t slot_count_;
  std::vector<int64_t> inputs_;
  std::vector<Instruction> program_;
  std::vector<int64_t> outputs_;
  std::vector<int64_t> selection_;  // run_selected: the arguments read after the folded constants
  mutable std::atomic<int64_t> direct_calls_{0};  // fused ops run through their entry points, all runs
  mutable std::atomic<int64_t> memoised_views_{0};  // view ops that repeated their first call's results, all runs
  bool output_is_list_;
  bool below_autograd_allowed_;
  size_t view_geometries_;  // per view op, the input geometries whose views are memoised (0: none)
};

}  // namespace

void bind_executor(py::module_& m) {
  py::class_<Program, std::shared_ptr<Program>>(
      m, "Program", "A fused graph's lowered program (compilation/runtime/lowering.py) run from C++.")
      .def(py::init<const py::object&, int64_t>(), py::arg("program"), py::arg("view_geometries") = 8)
      .def("run", &Program::run, py::arg("args"), py::arg("no_grad") = false)
      .def("run_selected", &Program::run_selected, py::arg("folded"), py::arg("args"), py::arg("no_grad"))
      .def_property("selection", &Program::selection, &Program::set_selection)
      .def_property_readonly("direct_calls", &Program::direct_calls,
                             "Fused ops and linear layers run through their C++ entry points, over all runs.")
      .def_property_readonly("memoised_views", &Program::memoised_views,
                             "View ops whose results repeated their first call's geometry (no call), over all runs.")
      .def_property_readonly("view_memo_bytes", &Program::view_memo_bytes,
                             "Bytes the view memo holds: every view op's entries and what the filled ones keep.")
      .def("__len__", &Program::size);
  m.def("executor_entries", &entry_names,
        "The names of the fused ops whose C++ entry points the executor calls straight (registered beside each "
        "kernel), sorted.");
}

}  // namespace mindiesd_cpu
