// Minimal declarations so that the wheel's threadpool.h (which includes
// <pthreadpool.h>, not shipped in the wheel) compiles. The runner only calls
// ThreadPool members; the pthreadpool library itself lives in _portable_lib.
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
typedef struct pthreadpool* pthreadpool_t;
void pthreadpool_destroy(pthreadpool_t threadpool);
#ifdef __cplusplus
}
#endif
