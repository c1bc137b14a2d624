/* sharedmp._cframe: (skeleton, filled in by its own change) */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sharedmp._cframe", NULL, 0, NULL, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cframe(void) { return PyModuleDef_Init(&module); }
