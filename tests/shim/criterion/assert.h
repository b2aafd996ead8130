/* Criterion 2.4's classic assertion macros (criterion/assert.h) for the
 * in-process shim; see criterion.h and tests/shim/README.md.
 *
 * Same semantics as Criterion: every macro takes an optional printf-style
 * message (a string literal, then its arguments) after its operands, which
 * replaces the default message when it is not empty. The message arguments
 * are evaluated only when the check fails. cr_assert* stop the test,
 * cr_expect* record the failure and continue. Operands are evaluated as in
 * Criterion (the float comparisons evaluate theirs twice). */
/* first, so that criterion.h sees this header whole whichever is included first */
#include "criterion.h"

#ifndef CRITERION_SHIM_ASSERT_H_
#define CRITERION_SHIM_ASSERT_H_

/* ---- argument-list helpers ----------------------------------------------
 * CRS_HEAD(a, ...) -> a; CRS_TAIL(a, ...) -> the rest, or nothing for a
 * single argument (up to 64 arguments). Standard C11, no GNU extensions. */

#define CRS_STR_(x) #x
#define CRS_STR(x) CRS_STR_(x)
#define CRS_CAT_(a, b) a##b
#define CRS_CAT(a, b) CRS_CAT_(a, b)

#define CRS_HEAD(...) CRS_HEAD_(__VA_ARGS__, ~)
#define CRS_HEAD_(x, ...) x

#define CRS_ARG65_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17,  \
                   _18, _19, _20, _21, _22, _23, _24, _25, _26, _27, _28, _29, _30, _31, _32,  \
                   _33, _34, _35, _36, _37, _38, _39, _40, _41, _42, _43, _44, _45, _46, _47,  \
                   _48, _49, _50, _51, _52, _53, _54, _55, _56, _57, _58, _59, _60, _61, _62,  \
                   _63, _64, N, ...)                                                            \
    N
/* 1 when called with exactly one argument, 0 otherwise */
#define CRS_IS_ONE_(...)                                                                        \
    CRS_ARG65_(__VA_ARGS__, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
               0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
               0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, ~)
#define CRS_TAIL(...) CRS_CAT(CRS_TAIL_, CRS_IS_ONE_(__VA_ARGS__))(__VA_ARGS__)
#define CRS_TAIL_1(x)
#define CRS_TAIL_0(x, ...) __VA_ARGS__

/* ---- core ------------------------------------------------------------------
 * Kind: abort (cr_assert*) or continue (cr_expect*). DefMsg: an expression
 * giving Criterion's default message as a malloc'd string; evaluated only on
 * failure. The trailing arguments are the user's optional message. */

#define CRS_KIND_ABORT_ crs_fail_abort_
#define CRS_KIND_CONTINUE_ crs_fail_continue_

#define CRS_CHECK_(Kind, Cond, DefMsg, ...)                                                     \
    do {                                                                                        \
        if (!(Cond))                                                                            \
            Kind(__FILE__, __LINE__, DefMsg, "x" __VA_ARGS__);                                  \
    } while (0)

#define CRS_MSG_(Literal) crs_format_("%s", Literal)
#define CRS_EXPR_FALSE_(ExprStr) CRS_MSG_("The expression " ExprStr " is false.")

/* cr_assert(Cond [, Fmt, ...]) */
#define CRS_COND_(Kind, ...)                                                                    \
    CRS_CHECK_(Kind, CRS_HEAD(__VA_ARGS__), CRS_EXPR_FALSE_(CRS_STR(CRS_HEAD(__VA_ARGS__))),    \
               CRS_TAIL(__VA_ARGS__))
#define CRS_NOT_(Kind, ...)                                                                     \
    CRS_CHECK_(Kind, !(CRS_HEAD(__VA_ARGS__)),                                                  \
               CRS_EXPR_FALSE_(CRS_STR(!(CRS_HEAD(__VA_ARGS__)))), CRS_TAIL(__VA_ARGS__))

/* binary comparison: (Actual) Op (Expected) */
#define CRS_OP_(Kind, Op, ...)                                                                  \
    CRS_OP2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),                  \
             CRS_TAIL(CRS_TAIL(__VA_ARGS__)))
#define CRS_OP2_(Kind, Op, A, B, ...)                                                           \
    CRS_CHECK_(Kind, (A) Op (B), CRS_EXPR_FALSE_(CRS_STR((A) Op (B))), __VA_ARGS__)

/* pointer against NULL */
#define CRS_NULL_(Kind, Op, Msg, ...)                                                           \
    CRS_NULL2_(Kind, Op, Msg, CRS_HEAD(__VA_ARGS__), CRS_TAIL(__VA_ARGS__))
#define CRS_NULL2_(Kind, Op, Msg, V, ...)                                                       \
    CRS_CHECK_(Kind, (V) Op NULL, CRS_MSG_(CRS_STR(V) Msg), __VA_ARGS__)

/* floating point with an epsilon (Criterion's exact expressions) */
#define CRS_FLOAT_EQ_OP_(A, E, Eps) (E) - (A) <= (Eps) && (A) - (E) <= (Eps)
#define CRS_FLOAT_NEQ_OP_(A, E, Eps) (E) - (A) > (Eps) || (A) - (E) > (Eps)
#define CRS_FLOAT_(Kind, Op, ...)                                                               \
    CRS_FLOAT2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),               \
                CRS_HEAD(CRS_TAIL(CRS_TAIL(__VA_ARGS__))),                                      \
                CRS_TAIL(CRS_TAIL(CRS_TAIL(__VA_ARGS__))))
#define CRS_FLOAT2_(Kind, Op, A, E, Eps, ...)                                                   \
    CRS_CHECK_(Kind, Op(A, E, Eps), CRS_EXPR_FALSE_(CRS_STR(Op(A, E, Eps))), __VA_ARGS__)

/* strings: both evaluated once; NULL never compares */
#define CRS_STROP_(Kind, Op, ...)                                                               \
    CRS_STROP2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),               \
                CRS_TAIL(CRS_TAIL(__VA_ARGS__)))
#define CRS_STROP2_(Kind, Op, A, E, ...)                                                        \
    do {                                                                                        \
        const char *crs_str_a_ = (A);                                                           \
        const char *crs_str_e_ = (E);                                                           \
        CRS_CHECK_(Kind, crs_str_a_ && crs_str_e_ && strcmp(crs_str_a_, crs_str_e_) Op 0,       \
                   crs_format_("The expression (as strings) %s is false: actual=`%s` "          \
                               "expected=`%s`.",                                                \
                               CRS_STR((A) Op (E)), crs_str_a_ ? crs_str_a_ : "(null)",         \
                               crs_str_e_ ? crs_str_e_ : "(null)"),                             \
                   __VA_ARGS__);                                                                \
    } while (0)

#define CRS_STREMPTY_(Kind, Op, ...)                                                            \
    CRS_STREMPTY2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_TAIL(__VA_ARGS__))
#define CRS_STREMPTY2_(Kind, Op, V, ...)                                                        \
    do {                                                                                        \
        const char *crs_str_v_ = (V);                                                           \
        CRS_CHECK_(Kind, crs_str_v_ && crs_str_v_[0] Op '\0',                                   \
                   !crs_str_v_ ? crs_format_("%s is null.", CRS_STR(V))                         \
                   : crs_str_v_[0] ? crs_format_("%s (`%s`) is not empty.", CRS_STR(V),         \
                                                 crs_str_v_)                                    \
                                   : crs_format_("%s is empty.", CRS_STR(V)),                   \
                   __VA_ARGS__);                                                                \
    } while (0)

/* wide strings */
#define CRS_WCSOP_(Kind, Op, ...)                                                               \
    CRS_WCSOP2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),               \
                CRS_TAIL(CRS_TAIL(__VA_ARGS__)))
#define CRS_WCSOP2_(Kind, Op, A, E, ...)                                                        \
    do {                                                                                        \
        const wchar_t *crs_wcs_a_ = (A);                                                        \
        const wchar_t *crs_wcs_e_ = (E);                                                        \
        CRS_CHECK_(Kind, crs_wcs_a_ && crs_wcs_e_ && wcscmp(crs_wcs_a_, crs_wcs_e_) Op 0,       \
                   CRS_EXPR_FALSE_(CRS_STR((A) Op (E))), __VA_ARGS__);                          \
    } while (0)

#define CRS_WCSEMPTY_(Kind, Op, ...)                                                            \
    CRS_WCSEMPTY2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_TAIL(__VA_ARGS__))
#define CRS_WCSEMPTY2_(Kind, Op, V, ...)                                                        \
    do {                                                                                        \
        const wchar_t *crs_wcs_v_ = (V);                                                        \
        CRS_CHECK_(Kind, crs_wcs_v_ && crs_wcs_v_[0] Op L'\0',                                  \
                   !crs_wcs_v_ ? crs_format_("%s is null.", CRS_STR(V))                         \
                   : crs_wcs_v_[0] ? crs_format_("%s is not empty.", CRS_STR(V))                \
                                   : crs_format_("%s is empty.", CRS_STR(V)),                   \
                   __VA_ARGS__);                                                                \
    } while (0)

/* arrays: Size is in bytes (memcmp), as in Criterion */
#define CRS_MEM_(Kind, Op, ...)                                                                 \
    CRS_MEM2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),                 \
              CRS_HEAD(CRS_TAIL(CRS_TAIL(__VA_ARGS__))),                                        \
              CRS_TAIL(CRS_TAIL(CRS_TAIL(__VA_ARGS__))))
#define CRS_MEM2_(Kind, Op, A, E, Size, ...)                                                    \
    CRS_CHECK_(Kind, memcmp((A), (E), (Size)) Op 0,                                             \
               CRS_EXPR_FALSE_(CRS_STR((A)[0..Size] Op (E)[0..Size])), __VA_ARGS__)

/* arrays with a comparator: Size elements, Cmp(&a[i], &e[i]) like Criterion */
#define CRS_ARRCMP_(Kind, Op, ...)                                                              \
    CRS_ARRCMP2_(Kind, Op, CRS_HEAD(__VA_ARGS__), CRS_HEAD(CRS_TAIL(__VA_ARGS__)),              \
                 CRS_HEAD(CRS_TAIL(CRS_TAIL(__VA_ARGS__))),                                     \
                 CRS_HEAD(CRS_TAIL(CRS_TAIL(CRS_TAIL(__VA_ARGS__)))),                           \
                 CRS_TAIL(CRS_TAIL(CRS_TAIL(CRS_TAIL(__VA_ARGS__)))))
#define CRS_ARRCMP2_(Kind, Op, A, E, Size, Cmp, ...)                                            \
    do {                                                                                        \
        __typeof__(&(A)[0]) crs_arr_a_ = (A);                                                   \
        __typeof__(&(E)[0]) crs_arr_e_ = (E);                                                   \
        int crs_arr_order_ = 0;                                                                 \
        for (size_t crs_arr_i_ = 0, crs_arr_n_ = (Size); !crs_arr_order_ && crs_arr_i_ < crs_arr_n_; \
             ++crs_arr_i_)                                                                      \
            crs_arr_order_ = Cmp(crs_arr_a_ + crs_arr_i_, crs_arr_e_ + crs_arr_i_);             \
        CRS_CHECK_(Kind, crs_arr_order_ Op 0,                                                   \
                   CRS_EXPR_FALSE_(CRS_STR((A)[0..Size] Op (E)[0..Size])), __VA_ARGS__);        \
    } while (0)

/* ---- public macros ------------------------------------------------------- */

#define cr_assert_fail(...)                                                                     \
    crs_fail_abort_(__FILE__, __LINE__,                                                         \
                    CRS_MSG_("The conditions for this assertion were not met."), "x" __VA_ARGS__)
#define cr_expect_fail(...)                                                                     \
    crs_fail_continue_(__FILE__, __LINE__,                                                      \
                       CRS_MSG_("The conditions for this assertion were not met."),             \
                       "x" __VA_ARGS__)
#define cr_skip_test(...) crs_skip_("x" __VA_ARGS__)

#define cr_assert(...) CRS_COND_(CRS_KIND_ABORT_, __VA_ARGS__)
#define cr_expect(...) CRS_COND_(CRS_KIND_CONTINUE_, __VA_ARGS__)
#define cr_assert_not(...) CRS_NOT_(CRS_KIND_ABORT_, __VA_ARGS__)
#define cr_expect_not(...) CRS_NOT_(CRS_KIND_CONTINUE_, __VA_ARGS__)

#define cr_assert_eq(...) CRS_OP_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_eq(...) CRS_OP_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_neq(...) CRS_OP_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_neq(...) CRS_OP_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_lt(...) CRS_OP_(CRS_KIND_ABORT_, <, __VA_ARGS__)
#define cr_expect_lt(...) CRS_OP_(CRS_KIND_CONTINUE_, <, __VA_ARGS__)
#define cr_assert_leq(...) CRS_OP_(CRS_KIND_ABORT_, <=, __VA_ARGS__)
#define cr_expect_leq(...) CRS_OP_(CRS_KIND_CONTINUE_, <=, __VA_ARGS__)
#define cr_assert_gt(...) CRS_OP_(CRS_KIND_ABORT_, >, __VA_ARGS__)
#define cr_expect_gt(...) CRS_OP_(CRS_KIND_CONTINUE_, >, __VA_ARGS__)
#define cr_assert_geq(...) CRS_OP_(CRS_KIND_ABORT_, >=, __VA_ARGS__)
#define cr_expect_geq(...) CRS_OP_(CRS_KIND_CONTINUE_, >=, __VA_ARGS__)

#define cr_assert_null(...) CRS_NULL_(CRS_KIND_ABORT_, ==, " is not null.", __VA_ARGS__)
#define cr_expect_null(...) CRS_NULL_(CRS_KIND_CONTINUE_, ==, " is not null.", __VA_ARGS__)
#define cr_assert_not_null(...) CRS_NULL_(CRS_KIND_ABORT_, !=, " is null.", __VA_ARGS__)
#define cr_expect_not_null(...) CRS_NULL_(CRS_KIND_CONTINUE_, !=, " is null.", __VA_ARGS__)

#define cr_assert_float_eq(...) CRS_FLOAT_(CRS_KIND_ABORT_, CRS_FLOAT_EQ_OP_, __VA_ARGS__)
#define cr_expect_float_eq(...) CRS_FLOAT_(CRS_KIND_CONTINUE_, CRS_FLOAT_EQ_OP_, __VA_ARGS__)
#define cr_assert_float_neq(...) CRS_FLOAT_(CRS_KIND_ABORT_, CRS_FLOAT_NEQ_OP_, __VA_ARGS__)
#define cr_expect_float_neq(...) CRS_FLOAT_(CRS_KIND_CONTINUE_, CRS_FLOAT_NEQ_OP_, __VA_ARGS__)

#define cr_assert_str_empty(...) CRS_STREMPTY_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_str_empty(...) CRS_STREMPTY_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_str_not_empty(...) CRS_STREMPTY_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_str_not_empty(...) CRS_STREMPTY_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_str_eq(...) CRS_STROP_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_str_eq(...) CRS_STROP_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_str_neq(...) CRS_STROP_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_str_neq(...) CRS_STROP_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_str_lt(...) CRS_STROP_(CRS_KIND_ABORT_, <, __VA_ARGS__)
#define cr_expect_str_lt(...) CRS_STROP_(CRS_KIND_CONTINUE_, <, __VA_ARGS__)
#define cr_assert_str_leq(...) CRS_STROP_(CRS_KIND_ABORT_, <=, __VA_ARGS__)
#define cr_expect_str_leq(...) CRS_STROP_(CRS_KIND_CONTINUE_, <=, __VA_ARGS__)
#define cr_assert_str_gt(...) CRS_STROP_(CRS_KIND_ABORT_, >, __VA_ARGS__)
#define cr_expect_str_gt(...) CRS_STROP_(CRS_KIND_CONTINUE_, >, __VA_ARGS__)
#define cr_assert_str_geq(...) CRS_STROP_(CRS_KIND_ABORT_, >=, __VA_ARGS__)
#define cr_expect_str_geq(...) CRS_STROP_(CRS_KIND_CONTINUE_, >=, __VA_ARGS__)

#define cr_assert_wcs_empty(...) CRS_WCSEMPTY_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_wcs_empty(...) CRS_WCSEMPTY_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_wcs_not_empty(...) CRS_WCSEMPTY_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_wcs_not_empty(...) CRS_WCSEMPTY_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_wcs_eq(...) CRS_WCSOP_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_wcs_eq(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_wcs_neq(...) CRS_WCSOP_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_wcs_neq(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_wcs_lt(...) CRS_WCSOP_(CRS_KIND_ABORT_, <, __VA_ARGS__)
#define cr_expect_wcs_lt(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, <, __VA_ARGS__)
#define cr_assert_wcs_leq(...) CRS_WCSOP_(CRS_KIND_ABORT_, <=, __VA_ARGS__)
#define cr_expect_wcs_leq(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, <=, __VA_ARGS__)
#define cr_assert_wcs_gt(...) CRS_WCSOP_(CRS_KIND_ABORT_, >, __VA_ARGS__)
#define cr_expect_wcs_gt(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, >, __VA_ARGS__)
#define cr_assert_wcs_geq(...) CRS_WCSOP_(CRS_KIND_ABORT_, >=, __VA_ARGS__)
#define cr_expect_wcs_geq(...) CRS_WCSOP_(CRS_KIND_CONTINUE_, >=, __VA_ARGS__)

#define cr_assert_arr_eq(...) CRS_MEM_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_arr_eq(...) CRS_MEM_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_arr_neq(...) CRS_MEM_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_arr_neq(...) CRS_MEM_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)

#define cr_assert_arr_eq_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, ==, __VA_ARGS__)
#define cr_expect_arr_eq_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, ==, __VA_ARGS__)
#define cr_assert_arr_neq_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, !=, __VA_ARGS__)
#define cr_expect_arr_neq_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, !=, __VA_ARGS__)
#define cr_assert_arr_lt_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, <, __VA_ARGS__)
#define cr_expect_arr_lt_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, <, __VA_ARGS__)
#define cr_assert_arr_leq_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, <=, __VA_ARGS__)
#define cr_expect_arr_leq_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, <=, __VA_ARGS__)
#define cr_assert_arr_gt_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, >, __VA_ARGS__)
#define cr_expect_arr_gt_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, >, __VA_ARGS__)
#define cr_assert_arr_geq_cmp(...) CRS_ARRCMP_(CRS_KIND_ABORT_, >=, __VA_ARGS__)
#define cr_expect_arr_geq_cmp(...) CRS_ARRCMP_(CRS_KIND_CONTINUE_, >=, __VA_ARGS__)

#endif /* !CRITERION_SHIM_ASSERT_H_ */
