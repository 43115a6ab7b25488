// Package bucketset is the one set of bucket ids of the module, a bitset
// of a fixed number of buckets: the transaction's touched buckets and the
// notifier's pending hints are both one.
package bucketset

import "math/bits"

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
