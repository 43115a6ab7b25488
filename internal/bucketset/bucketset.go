// Package bucketset is the one set of bucket ids of the module, a bitset
// of a fixed number of buckets: the transaction's touched buckets are one,
// and Hints, the pending hints of the notifier and of the hint bridge,
// holds one.
package bucketset

import (
	"math/bits"
	"sync"
)

// Set holds bucket ids 0..n-1. The zero value holds nothing and accepts
// nothing; make one with New.
type Set struct {
	n     int
	words []uint64
}

// New returns an empty set of n buckets.
func New(n int) Set {
	n = max(n, 0)
	return Set{n: n, words: make([]uint64, (n+63)/64)}
}

// Size is the number of buckets the set can hold, 0 for the zero value.
func (s *Set) Size() int { return s.n }

// Contains reports whether b is in range and in the set.
func (s *Set) Contains(b int) bool {
	return b >= 0 && b < s.n && s.words[b/64]&(1<<(uint(b)%64)) != 0
}

// Add puts b in the set and reports whether it was added: false when it
// was already there or is outside 0..n-1.
func (s *Set) Add(b int) bool {
	if b < 0 || b >= s.n || s.Contains(b) {
		return false
	}
	s.words[b/64] |= 1 << (uint(b) % 64)
	return true
}

// Remove takes b out of the set; a bucket out of range is ignored.
func (s *Set) Remove(b int) {
	if b >= 0 && b < s.n {
		s.words[b/64] &^= 1 << (uint(b) % 64)
	}
}

// Drain appends the buckets of the set to dst in ascending order, empties
// the set and returns dst.
func (s *Set) Drain(dst []int) []int {
	for w, word := range s.words {
		for word != 0 {
			i := bits.TrailingZeros64(word)
			dst = append(dst, w*64+i)
			word &^= 1 << uint(i)
		}
		s.words[w] = 0
	}
	return dst
}

// Hints gathers bucket hints until they are taken: the buckets in range,
// and whether a hint named one outside it (an unknown bucket, for which
// the reader must discover the pending buckets itself). Its memory is
// bounded by the bucket count however many hints arrive. It is safe for
// concurrent use; make one with NewHints.
type Hints struct {
	mu      sync.Mutex
	set     Set
	any     bool // something was recorded since the last Take
	unknown bool
}

// NewHints returns an empty Hints of n buckets.
func NewHints(n int) *Hints { return &Hints{set: New(n)} }

// Add records buckets; one outside 0..n-1 records an unknown hint.
func (h *Hints) Add(buckets []int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, b := range buckets {
		if !h.set.Add(b) && !h.set.Contains(b) {
			h.unknown = true
		}
	}
	h.any = true
}

// AddUnknown records an unknown hint.
func (h *Hints) AddUnknown() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unknown = true
	h.any = true
}

// Take appends the recorded buckets to dst in ascending order, clears
// them, and reports whether an unknown hint was recorded.
func (h *Hints) Take(dst []int) (buckets []int, unknown bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.any {
		return dst, false
	}
	dst = h.set.Drain(dst)
	unknown = h.unknown
	h.any, h.unknown = false, false
	return dst, unknown
}
