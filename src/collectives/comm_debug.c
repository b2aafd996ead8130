/* placeholder: being written */
typedef int tp__placeholder_t;
