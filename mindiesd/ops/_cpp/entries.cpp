// The registry of the executor's entries and the argument reader they share (entries.h).

#include "entries.h"

#include <ATen/core/ivalue.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

namespace mindiesd_cpu {
namespace {

struct Registry {
  std::mutex lock;
  std::map<std::string, EntryFn> entries;  // nullptr: registered twice
};

// Built on its first use, so that registrars in any translation unit may run first.  Defined here, not inline in
// a header: a function-local static of an inline function would be one object shared by every build of the
// kernels loaded into the process (one per instruction set), whose entries would then collide.
Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

const at::Tensor& EntryArgs::tensor(size_t index) const {
  return values_.at(index).toTensor();
}

std::optional<at::Tensor> EntryArgs::optional_tensor(size_t index) const {
  const c10::IValue& value = values_.at(index);
  if (value.isNone()) {
    return std::nullopt;
  }
  return value.toTensor();
}

std::vector<at::Tensor> EntryArgs::tensors(size_t index) const {
  return values_.at(index).toTensorVector();
}

std::vector<std::optional<at::Tensor>> EntryArgs::optional_tensors(size_t index) const {
  std::vector<std::optional<at::Tensor>> result;
  for (const c10::IValue& value : values_.at(index).toListRef()) {
    result.push_back(value.isNone() ? std::nullopt : std::optional<at::Tensor>(value.toTensor()));
  }
  return result;
}

double EntryArgs::to_double(size_t index) const {
  return values_.at(index).toDouble();
}

int64_t EntryArgs::to_int(size_t index) const {
  return values_.at(index).toInt();
}

bool EntryArgs::to_bool(size_t index) const {
  return values_.at(index).toBool();
}

const std::string& EntryArgs::to_string(size_t index) const {
  return values_.at(index).toStringRef();
}

std::optional<at::ScalarType> EntryArgs::optional_dtype(size_t index) const {
  const c10::IValue& value = values_.at(index);
  if (value.isNone()) {
    return std::nullopt;
  }
  return value.toScalarType();
}

at::ScalarType EntryArgs::out_dtype() const {
  return out_dtype_.value();
}

void register_entry(const std::string& name, EntryFn fn) {
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.lock);
  const auto [it, inserted] = r.entries.emplace(name, fn);
  if (!inserted) {
    it->second = nullptr;
  }
}

EntryFn find_entry(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.lock);
  const auto it = r.entries.find(name);
  if (it == r.entries.end()) {
    return nullptr;
  }
  if (it->second == nullptr) {
    throw std::logic_error("the C++ entry point " + name + " is registered twice");
  }
  return it->second;
}

std::vector<std::string> entry_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.lock);
  std::vector<std::string> names;
  names.reserve(r.entries.size());
  for (const auto& item : r.entries) {
    names.push_back(item.first);
  }
  return names;
}

}  // namespace mindiesd_cpu
