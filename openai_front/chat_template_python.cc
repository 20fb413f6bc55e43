#include "openai_front/chat_template_python.h"

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace kvwire::openai {
namespace {

PyObject* Obj(void* p) { return static_cast<PyObject*>(p); }

std::string StrOf(PyObject* o) {
  PyObject* s = o ? PyObject_Str(o) : nullptr;
  Py_ssize_t n = 0;
  const char* utf8 = s ? PyUnicode_AsUTF8AndSize(s, &n) : nullptr;
  std::string out = utf8 ? std::string(utf8, n) : std::string("(unprintable)");
  if (!utf8) PyErr_Clear();
  Py_XDECREF(s);
  return out;
}

// The pending Python exception as text ("TypeName: message"), cleared; `is_error` says
// whether it is an instance of `error_class`.
std::string TakeException(PyObject* error_class, bool* is_error) {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  *is_error = error_class && value && PyObject_IsInstance(value, error_class) == 1;
  std::string text =
      *is_error ? StrOf(value)
                : absl::StrCat(type ? reinterpret_cast<PyTypeObject*>(type)->tp_name : "error",
                               ": ", StrOf(value));
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

absl::Status StartInterpreter() {
  static std::once_flag once;
  static absl::Status status;
  std::call_once(once, [] {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;  // SIGTERM and SIGINT are the front's (sigwait)
    config.use_environment = 0;          // a PYTHONPATH or PYTHONHOME meant for another Python
    config.user_site_directory = 0;
    config.parse_argv = 0;
    config.write_bytecode = 0;
    PyStatus st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st)) {
      status = absl::FailedPreconditionError(
          absl::StrCat("the embedded Python interpreter did not start: ",
                       st.err_msg ? st.err_msg : "unknown error"));
      return;
    }
    PyEval_SaveThread();  // the lock is taken by each call, from any thread
  });
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Load(const std::string& python_dir,
                                                                 const std::string& model_dir,
                                                                 const std::string& override_file) {
  if (absl::Status st = StartInterpreter(); !st.ok()) return st;
  std::unique_ptr<ChatTemplate> t(new ChatTemplate());
  PyGILState_STATE gil = PyGILState_Ensure();
  absl::Status status;
  PyObject* module = nullptr;
  PyObject* path = PySys_GetObject("path");  // borrowed
  PyObject* dir = PyUnicode_FromString(python_dir.c_str());
  if (path && dir) PyList_Insert(path, 0, dir);
  Py_XDECREF(dir);
  module = PyImport_ImportModule("chat_template");
  bool is_error = false;
  if (module == nullptr) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "cannot import chat_template from ", python_dir, " (", TakeException(nullptr, &is_error),
        "): --python-dir names the folder of chat_template.py, and Debian's python3-jinja2 must "
        "be installed"));
  } else {
    t->render_ = PyObject_GetAttrString(module, "render_prompt");
    t->error_ = PyObject_GetAttrString(module, "TemplateError");
    PyObject* cls = PyObject_GetAttrString(module, "ChatTemplate");
    PyObject* tpl =
        cls ? PyObject_CallMethod(cls, "for_model", "ss", model_dir.c_str(), override_file.c_str())
            : nullptr;
    if (tpl == nullptr || t->render_ == nullptr || t->error_ == nullptr) {
      Py_XDECREF(tpl);
      status = absl::InvalidArgumentError(
          absl::StrCat("the chat template of '", override_file.empty() ? model_dir : override_file,
                       "' did not load: ", TakeException(nullptr, &is_error)));
    } else {
      t->template_ = tpl;
      PyObject* origin = PyObject_GetAttrString(tpl, "origin");
      t->origin_ = StrOf(origin);
      Py_XDECREF(origin);
    }
    Py_XDECREF(cls);
    Py_DECREF(module);
  }
  PyGILState_Release(gil);
  if (!status.ok()) return status;
  return t;
}

ChatTemplate::~ChatTemplate() {
  if (!Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_XDECREF(Obj(template_));
  Py_XDECREF(Obj(render_));
  Py_XDECREF(Obj(error_));
  PyGILState_Release(gil);
}

absl::StatusOr<std::string> ChatTemplate::Render(const std::string& messages_json,
                                                 bool add_generation_prompt) const {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* text = PyObject_CallFunction(Obj(render_), "Os#O", Obj(template_), messages_json.data(),
                                         static_cast<Py_ssize_t>(messages_json.size()),
                                         add_generation_prompt ? Py_True : Py_False);
  absl::StatusOr<std::string> out;
  if (text == nullptr) {
    // A template's raise_exception is a TemplateError; any other exception (a TypeError of an
    // expression over unusual messages, say) is also these messages failing this template.
    bool is_error = false;
    std::string what = TakeException(Obj(error_), &is_error);
    out = absl::InvalidArgumentError(what);
  } else {
    Py_ssize_t n = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(text, &n);
    if (utf8 == nullptr) {
      bool is_error = false;
      out = absl::InvalidArgumentError(
          absl::StrCat("the rendered prompt is not text: ", TakeException(nullptr, &is_error)));
    } else {
      out = std::string(utf8, n);
    }
    Py_DECREF(text);
  }
  PyGILState_Release(gil);
  return out;
}

}  // namespace kvwire::openai
