// The executor's entries: each fused op with a C++ kernel registers, beside
// that kernel (in its own <op>.cpp), the function the executor (executor.cpp)
// calls straight for it, under the op's name.  The executor looks an entry up
// by that name when it builds a program, so it names no fused op itself.
//
// An entry reads the op's leading schema arguments, as the program converted
// them, through EntryArgs, and returns the kernel's result, or std::nullopt
// where the kernel does not cover the form; it may throw.  Either way the
// executor then runs the op's own boxed call.
//
// EntryArgs reads the arguments out of line (entries.cpp) so that the op
// sources need not parse ATen's IValue headers.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace c10 {
struct IValue;
}  // namespace c10

namespace mindiesd_cpu {

// The arguments of one straight call: the values of the op's leading schema arguments, in order, and the output
// dtype the program resolved for the ops that take one.  Each accessor converts the value at ``index`` as the
// IValue method it names does, and throws where the value has another type or ``index`` is past the last.
class EntryArgs {
 public:
  EntryArgs(const std::vector<c10::IValue>& values, std::optional<at::ScalarType> out_dtype)
      : values_(values), out_dtype_(out_dtype) {}

  const at::Tensor& tensor(size_t index) const;                           // toTensor()
  std::optional<at::Tensor> optional_tensor(size_t index) const;         // None: nullopt
  std::vector<at::Tensor> tensors(size_t index) const;                   // toTensorVector()
  std::vector<std::optional<at::Tensor>> optional_tensors(size_t index) const;  // a list, None: nullopt
  double to_double(size_t index) const;                                  // toDouble()
  int64_t to_int(size_t index) const;                                    // toInt()
  bool to_bool(size_t index) const;                                      // toBool()
  const std::string& to_string(size_t index) const;                      // toStringRef()
  std::optional<at::ScalarType> optional_dtype(size_t index) const;      // None: nullopt, else toScalarType()
  // The resolved output dtype (throws where the program resolved none).
  at::ScalarType out_dtype() const;

 private:
  const std::vector<c10::IValue>& values_;
  std::optional<at::ScalarType> out_dtype_;
};

using EntryFn = std::optional<at::Tensor> (*)(const EntryArgs& args);

// Registers ``fn`` as the entry named ``name`` (a fused op's name).  Called during static initialisation by an
// EntryRegistrar; a name registered twice is kept as a conflict that find_entry reports.
void register_entry(const std::string& name, EntryFn fn);

// The entry named ``name``, or nullptr where none is registered; throws std::logic_error for a name registered
// twice.
EntryFn find_entry(const std::string& name);

// The names of the registered entries, sorted.
std::vector<std::string> entry_names();

// Registers an entry when the library that holds it loads: one per op, at namespace scope beside its kernel.
struct EntryRegistrar {
  EntryRegistrar(const char* name, EntryFn fn) { register_entry(name, fn); }
};

}  // namespace mindiesd_cpu
