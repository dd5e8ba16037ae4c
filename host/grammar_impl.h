/* Private to host/grammar*.c: the nodes of a grammar, a matcher's frames, and one byte's step
 * (grammar.c), shared by the builder, the schema compiler (grammar_schema.c) and the matcher
 * (grammar_match.c). */
#ifndef MF_GRAMMAR_IMPL_H
#define MF_GRAMMAR_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "host/grammar.h"

enum {
    G_LIT,      /* a: offset in bytes, b: length */
    G_SEQ,      /* a: offset in kids, b: count */
    G_CHOICE,   /* a: offset in kids, b: count (first-byte map built at finish: c) */
    G_SWITCH,   /* a: offset in keys (sorted), b: count, c: offset in kids of the continuations (or NONE) */
    G_LOOP,     /* a: body, b: exit */
    G_UNTIL,    /* a: offset in bytes of the terminator, b: its length, c: offset in fail (KMP) */
    G_JSTR,     /* any JSON string */
    G_JNUM,     /* a JSON number; flags G_F_INT: an integer */
    G_JOBJ,     /* a: offset in props, b: count, c: additional value node (or NONE), m: required mask */
    G_OKEY,     /* a JSON object's key (pushed by G_JOBJ; a: the object node) */
    G_JARR,     /* a: item node, b: minItems, c: maxItems (NONE: no limit) */
    G_JANY,     /* any JSON value: a: any object, b: any array, c: true/false/null switch */
    G_N_KINDS
};

#define G_NONE 0xffffffffu
#define G_F_INT 1

typedef struct mf_gnode {
    uint8_t kind, flags;
    uint32_t a, b, c;
    uint64_t m;
} mf_gnode;

typedef struct mf_gkey {   /* a switch key or an object's property name (JSON-encoded, no quotes) */
    uint32_t off, len;
} mf_gkey;

typedef struct mf_gprop {
    mf_gkey name;
    uint32_t node;         /* its value */
} mf_gprop;

struct mf_gram {
    mf_gnode *nodes;
    int n_nodes;
    uint32_t root;
    unsigned char *bytes;
    uint32_t *kids;
    mf_gkey *keys;
    mf_gprop *props;
    uint32_t *fail;
    uint8_t (*first)[32];  /* per node: the bytes it may start with */
    uint8_t *cmap;         /* choices: per byte the kid index + 1 (0: none), 256 per choice */
};

/* A frame of a matcher's stack: the node it matches and its progress (meaning per kind). */
typedef struct mf_gframe {
    uint32_t node;
    uint32_t s, x, y;
    uint64_t m, m2;
} mf_gframe;

/* What a frame does with a byte. */
enum {
    G_REJECT,        /* the byte cannot come here */
    G_STAY,          /* consumed; the frame goes on */
    G_PUSH,          /* the frame waits for a child (given), which takes the byte */
    G_DONE,          /* consumed; the frame is complete (result given) */
    G_DONE_REFEED    /* not consumed: the frame was complete before it; its parent takes the byte */
};

/* One byte for frame f (updated in place) at stack depth `depth`: one of the above; G_PUSH fills
 * *child, G_DONE and G_DONE_REFEED set *result (a switch's key, an object key's property). */
int mf_gram_feed(const mf_gram *g, mf_gframe *f, unsigned char c, int depth, mf_gframe *child, uint32_t *result);
/* A child of f completed with result: 1 when f is then complete too, else 0 (f updated). */
int mf_gram_child_done(const mf_gram *g, mf_gframe *f, uint32_t result);
/* 1 when f could end without more bytes (a number, a switch key that others extend). */
int mf_gram_can_end(const mf_gram *g, const mf_gframe *f);
/* JSON nodes for the schema compiler (grammar_schema.c); ids or negative codes as the builders of
 * grammar.h. An object's properties are names (JSON-encoded, without quotes) and value nodes;
 * required is a mask over them; additional: the node of other keys' values, or -1: none. */
int mf_gram_json_str(mf_gram_b *b);
int mf_gram_json_num(mf_gram_b *b, int integer);
int mf_gram_json_arr(mf_gram_b *b, int item, uint32_t min, uint32_t max);
int mf_gram_json_obj(mf_gram_b *b, const char *const *names, const size_t *lens, const int *values, int n,
                     uint64_t required, int additional);

/* The frame that starts matching node n. */
mf_gframe mf_gram_frame(const mf_gram *g, uint32_t n);

#endif
