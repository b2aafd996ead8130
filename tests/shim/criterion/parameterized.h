/* Criterion 2.4's parameterized tests (criterion/parameterized.h) for the
 * in-process shim; see criterion.h.
 *
 *   ParameterizedTestParameters(suite, name)
 *   {
 *       static int values[] = {1, 2, 3};
 *       return cr_make_param_array(int, values, 3);   // optional 4th: cleanup
 *   }
 *   ParameterizedTest(int *v, suite, name, .timeout = 10) { ... *v ... }
 *
 * The runner calls the parameters function once, runs the test once per
 * element with a pointer to it (each run is reported and counted like one
 * test, as by Criterion), then calls the cleanup function if there is one. */
/* first, so that criterion.h sees this header whole whichever is included first */
#include "criterion.h"

#ifndef CRITERION_SHIM_PARAMETERIZED_H_
#define CRITERION_SHIM_PARAMETERIZED_H_

#define CRS_PARAM_TEST_BASE_(Param, Suite, Name, ...)                                          \
    void CRS_ID_(Suite, Name, impl)(Param);                                                    \
    static void CRS_ID_(Suite, Name, tramp)(void *crs_param_)                                  \
    {                                                                                          \
        CRS_ID_(Suite, Name, impl)(crs_param_);                                                \
    }                                                                                          \
    static struct criterion_test_extra_data CRS_ID_(Suite, Name, extra) = {__VA_ARGS__};       \
    static struct crs_test_ CRS_ID_(Suite, Name, meta) = {                                     \
        #Name, #Suite, __FILE__, __LINE__, NULL, CRS_ID_(Suite, Name, tramp),                  \
        CRS_ID_(Suite, Name, param), &CRS_ID_(Suite, Name, extra), NULL};                      \
    __attribute__((constructor)) static void CRS_ID_(Suite, Name, reg)(void)                   \
    {                                                                                          \
        crs_register_test_(&CRS_ID_(Suite, Name, meta));                                       \
    }                                                                                          \
    void CRS_ID_(Suite, Name, impl)(Param)

#define ParameterizedTest(...) CRS_PARAM_TEST_BASE_(__VA_ARGS__, .sentinel_ = 0)

#define ParameterizedTestParameters(Suite, Name)                                               \
    static struct criterion_test_params CRS_ID_(Suite, Name, param)(void)

/* cr_make_param_array(Type, Array, Len [, Cleanup]) */
#define cr_make_param_array(...) CRS_MAKE_PARAM_ARRAY_(__VA_ARGS__)
#define CRS_MAKE_PARAM_ARRAY_(Type, Array, ...)                                                \
    (struct criterion_test_params) { .size = sizeof(Type), (void *)(Array), __VA_ARGS__ }

#endif /* !CRITERION_SHIM_PARAMETERIZED_H_ */
