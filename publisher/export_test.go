package publisher

// FranzFailedTails is how many failed messages the Franz publisher keeps
// as chain tails (reported failed, their Send's wait not returned).
func FranzFailedTails(f *Franz) int {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	n := 0
	for _, r := range f.tails {
		if r.reported {
			n++
		}
	}
	return n
}
